"""The clickstream pipeline (``jobs/clickstream.py``): one micro-batch every 5 minutes.

Configuration (topics, S3 root, profile service) comes from ``MICROBATCH_CLICKSTREAM_*``
variables; services from the ``microbatch_*`` connections or ``MICROBATCH_*`` variables.
``MICROBATCH_CLICKSTREAM_SCHEDULE`` overrides the cron schedule (default every 5 minutes);
``MICROBATCH_CLICKSTREAM_ON_NEW_DATA=true`` (what ``make airflow`` sets) also runs a batch
as soon as clicks arrive (event-driven: ``docs/airflow.md``).
"""

from __future__ import annotations

import os
from pathlib import Path

from microbatch_airflow.dag_factory import microbatch_dag

microbatch_dag(
    "clickstream",
    Path(__file__).resolve().parents[1] / "jobs" / "clickstream.py",
    schedule=os.environ.get("MICROBATCH_CLICKSTREAM_SCHEDULE", "*/5 * * * *"),
    max_parallelism=64,  # the pipeline's max_parallelism (ClickstreamConfig)
    default_parallelism=2,
    # Backfills publish the reprocessed sessions to Kafka again: consumers dedupe by key.
    kafka_repeats_on_backfill=True,
    on_new_data=os.environ.get("MICROBATCH_CLICKSTREAM_ON_NEW_DATA", "").lower() in ("1", "true"),
)
