"""spark-submit target: the foundation smoke job (Kafka → Spark → Parquet on S3).

    spark-submit jobs/smoke.py --events 10000 --run-id demo

Settings come from ``MICROBATCH_*`` variables. The last line printed is
``MICROBATCH_RESULT {json}`` for callers (the demo, the Airflow task) to parse.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from microbatch.errors import MicrobatchError
from microbatch.settings import Settings
from microbatch.smoke import run_smoke, summary


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--events", type=int, default=10_000)
    parser.add_argument("--partitions", type=int, default=3)
    parser.add_argument("--run-id", default="demo")
    parser.add_argument("--topic", default=None, help="default: smoke-<run-id>")
    parser.add_argument("--no-produce", action="store_true", help="only read and write")
    args = parser.parse_args()
    try:
        result = run_smoke(
            Settings.from_env(),
            topic=args.topic or f"smoke-{args.run_id}",
            events=args.events,
            partitions=args.partitions,
            run_id=args.run_id,
            produce=not args.no_produce,
        )
    except MicrobatchError as exc:
        print(f"smoke job failed: {exc}", file=sys.stderr)
        return 1
    print(summary(result))
    print("MICROBATCH_RESULT " + json.dumps(dataclasses.asdict(result)), flush=True)
    return 0 if result.rows_in_parquet == result.records_read else 2


if __name__ == "__main__":
    sys.exit(main())
