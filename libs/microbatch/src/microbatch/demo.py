"""``make demo``: start the local stack, run the main job with spark-submit, summarize.

Services that were already running (or that the settings point elsewhere, e.g. an
external Kafka) are used as they are and left running; those this command started are
stopped at the end, also on failure or Ctrl-C. The job's full log goes to
``$MICROBATCH_HOME/demo.log``; the terminal shows progress and the job's summary.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
from pathlib import Path

from microbatch.errors import MicrobatchError
from microbatch.localstack import LocalStack, stop_on_sigterm
from microbatch.runner import run_job
from microbatch.settings import Settings

_SPARK_LOG_LINE = re.compile(
    r"^\d\d/\d\d/\d\d \d\d:\d\d:\d\d (INFO|WARN|ERROR) |^\s+at |^WARNING:|log4j profile"
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="microbatch-demo", description=__doc__)
    parser.add_argument("--job", required=True, help="path of the spark-submit target")
    parser.add_argument("--events", type=int, default=10_000)
    args = parser.parse_args(argv)
    stop_on_sigterm()
    settings = Settings.from_env()
    stack = LocalStack(settings)
    external = {
        "kafka": "MICROBATCH_KAFKA_BOOTSTRAP_SERVERS" in os.environ,
        "seaweedfs": "MICROBATCH_S3_ENDPOINT_URL" in os.environ,
    }
    started: list[str] = []
    log_path = settings.home_path / "demo.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    try:
        for name in ("kafka", "seaweedfs"):
            if external[name] or stack.services[name].process.pid() is not None:
                print(f"[stack] {name}: using the running/external service")
                continue
            print(f"[stack] starting {name} ...", flush=True)
            step = time.monotonic()
            stack.start(name)
            started.append(name)
            print(f"[stack] {name} ready in {time.monotonic() - step:.1f} s", flush=True)
        print(stack.describe())
        run_id = time.strftime("%Y%m%d-%H%M%S")
        print(f"[job] spark-submit {args.job} (master {settings.spark_master}); log: {log_path}")
        with open(log_path, "w") as log:

            def echo(line: str) -> None:
                log.write(line + "\n")
                if not _SPARK_LOG_LINE.search(line) and not line.startswith("running: "):
                    print(f"  {line}", flush=True)

            result = run_job(
                Path(args.job), ["--events", str(args.events), "--run-id", run_id], settings, echo
            )
        ok = result["rows_in_parquet"] == result["produced"] == result["records_read"]
        print(
            f"\n{'OK' if ok else 'MISMATCH'}: {result['produced']:,} events produced, "
            f"{result['records_read']:,} read, {result['rows_in_parquet']:,} rows in Parquet "
            f"({time.monotonic() - t0:.0f} s in all)"
        )
        return 0 if ok else 1
    except MicrobatchError as exc:
        print(f"\ndemo failed: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    finally:
        for name in reversed(started):
            stack.stop(name)
            print(f"[stack] stopped {name}")


if __name__ == "__main__":
    sys.exit(main())
