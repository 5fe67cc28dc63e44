"""``microbatch-stack up|down|status``: the embedded Kafka + SeaweedFS on loopback.

``--only postgres`` starts the PostgreSQL that ``make airflow`` keeps Airflow's metadata
in (port ``MICROBATCH_POSTGRES_PORT``, default 5433; user and password ``microbatch``).

``--only spark-cluster`` starts a standalone master (7077) with two workers and
``--only spark-connect`` a warm Spark Connect server (15002); ``down`` stops everything.

Ports come from the settings (``MICROBATCH_KAFKA_BOOTSTRAP_SERVERS``,
``MICROBATCH_S3_ENDPOINT_URL``); data, logs and pid files live under
``$MICROBATCH_HOME/stack``. ``up`` is idempotent: a service already running is left alone.
"""

from __future__ import annotations

import argparse
import sys
import time

from microbatch.errors import MicrobatchError
from microbatch.localstack import LocalStack
from microbatch.settings import Settings


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="microbatch-stack", description=__doc__)
    parser.add_argument("command", choices=["up", "down", "status"])
    parser.add_argument(
        "--only",
        choices=["kafka", "seaweedfs", "postgres", "spark-cluster", "spark-connect"],
        action="append",
        help="limit to a service (default: kafka and seaweedfs)",
    )
    args = parser.parse_args(argv)
    settings = Settings.from_env()
    stack = LocalStack(settings)
    services = args.only or ["kafka", "seaweedfs"]
    try:
        if args.command == "up":
            for name in services:
                started = time.monotonic()
                print(f"starting {name} ...", flush=True)
                stack.start(name)
                print(f"  {name} ready in {time.monotonic() - started:.1f} s", flush=True)
            print(stack.describe())
        elif args.command == "down":
            for name in args.only or list(stack.services):
                print(f"{name}: {'stopped' if stack.stop(name) else 'was not running'}")
        else:
            print(stack.describe())
    except MicrobatchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
