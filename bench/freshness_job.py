"""The pipeline ``bench_freshness.py`` schedules with Airflow: every record out, once.

Records ``{"id", "key", "produced_ms"}`` from Kafka → keyed by ``key`` → each record emitted
as it came (a count per key kept in value state, so the keyed path and the state write are
part of the batch) → a Parquet sink. The bench reads the sink as a reader would and takes
``now - produced_ms`` of every row the moment its batch becomes visible. Configured when
:func:`pipeline` is called, by ``MICROBATCH_FRESHNESS_TOPIC`` and ``MICROBATCH_FRESHNESS_ROOT``
(an ``s3://bucket/prefix`` for the sink and the checkpoints).
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

from microbatch.runtime import KafkaSource, KeyedProcessFunction, ParquetSink, Pipeline
from microbatch.settings import Settings


class EveryRecord(KeyedProcessFunction):
    """Emits each record with its key's running count."""

    def process(self, key: Any, records: Any, ctx: Any) -> None:
        seen = ctx.value("seen")
        count = seen.get(0)
        for record in records:
            count += 1
            ctx.emit({"id": record["id"], "key": key, "produced_ms": record["produced_ms"],
                      "nth": count})  # fmt: skip
        seen.set(count)


def pipeline(settings: Settings, env: Mapping[str, str]) -> Pipeline:
    root = env["MICROBATCH_FRESHNESS_ROOT"]
    return Pipeline(
        name="freshness",
        source=KafkaSource(topics=(env["MICROBATCH_FRESHNESS_TOPIC"],)),
        key_by="key",
        process=EveryRecord(),
        sinks=[ParquetSink("rows", f"{root}/rows")],
        checkpoints=f"{root}/checkpoints",
        max_parallelism=16,
        parallelism=2,
    )


if __name__ == "__main__":
    from microbatch.cli import exit_now, main

    exit_now(main(["run", f"{__file__}:pipeline", *sys.argv[1:]]))
