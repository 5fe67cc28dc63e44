"""Small pipelines the runtime tests run (shipped to Spark workers by value)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import pyarrow as pa

from microbatch.runtime import (
    DeadLetterSink,
    EventTime,
    KafkaSink,
    KafkaSource,
    KeyedProcessFunction,
    ParquetSink,
    Pipeline,
    ProcessContext,
)
from microbatch.sinks import DeltaSink, IcebergCatalog, IcebergSink, PostgresSink

COUNT_SCHEMA = pa.schema([("user", pa.string()), ("clicks", pa.int64()), ("total", pa.int64())])
PG_SCHEMA = pa.schema(
    [pa.field("user", pa.string(), nullable=False), ("clicks", pa.int64()), ("total", pa.int64())]
)


class CountClicks(KeyedProcessFunction):
    """Running click count per user; one output row per user per batch with clicks."""

    def process(self, key: Any, records: Sequence[Any], ctx: ProcessContext) -> None:
        total = ctx.value("total")
        new = total.get(0) + len(records)
        total.set(new)
        ctx.list("pages").add_all([r["page"] for r in records])
        if any(r.get("explode") for r in records):
            raise RuntimeError(f"boom for {key}")
        ctx.emit({"user": key, "clicks": len(records), "total": new})


class TimerEcho(KeyedProcessFunction):
    """Registers a timer 1 s after each click; emits when it fires."""

    def process(self, key: Any, records: Sequence[Any], ctx: ProcessContext) -> None:
        for r in records:
            ctx.register_timer(r["ts"] + 1000)

    def on_timer(self, key: Any, timestamp_ms: int, ctx: ProcessContext) -> None:
        ctx.emit({"user": key, "fired": timestamp_ms})


def count_pipeline(
    topic: str,
    root: str,
    *,
    out_topic: str | None = None,
    max_records_per_batch: int | None = None,
    on_process_error: str = "fail",
    parallelism: int = 2,
    kafka_first: bool = False,
    postgres: tuple[str, str] | None = None,
    delta: str | None = None,
    iceberg: str | None = None,
) -> Pipeline:
    """Click counts per user to Parquet (and to ``out_topic``; published first if
    ``kafka_first``, so a crash while publishing can leave its transaction open).
    ``postgres`` = (dsn, table prefix): also to PostgreSQL, published first — the users'
    totals upserted into ``<prefix>_totals`` and every row appended to ``<prefix>_log``.
    ``delta``: also to a Delta table at that URI; ``iceberg``: also to an Iceberg table
    with its SQLite catalog and warehouse in that folder."""
    sinks: list[Any] = [ParquetSink("counts", f"{root}/counts", COUNT_SCHEMA)]
    if out_topic is not None:
        kafka = KafkaSink("counts_topic", out_topic, key_field="user")
        sinks.insert(0 if kafka_first else 1, kafka)
    if postgres is not None:
        dsn, prefix = postgres
        sinks[:0] = [
            PostgresSink("totals_pg", f"{prefix}_totals", PG_SCHEMA, key="user", dsn=dsn),
            PostgresSink("log_pg", f"{prefix}_log", PG_SCHEMA, mode="append", dsn=dsn),
        ]
    if delta is not None:
        sinks.append(DeltaSink("counts_delta", delta, COUNT_SCHEMA))
    if iceberg is not None:
        catalog = IcebergCatalog.sql(f"sqlite:///{iceberg}/catalog.db", f"file://{iceberg}/wh")
        sinks.append(IcebergSink("counts_iceberg", "soak.counts", COUNT_SCHEMA, catalog=catalog))
    return Pipeline(
        name="counts",
        source=KafkaSource(topics=(topic,), max_records_per_batch=max_records_per_batch),
        key_by="user",
        process=CountClicks(),
        sinks=sinks,
        dead_letters=DeadLetterSink(path=f"{root}/dead"),
        checkpoints=f"{root}/checkpoints",
        max_parallelism=16,
        parallelism=parallelism,
        on_process_error=on_process_error,  # type: ignore[arg-type]
    )


def timer_pipeline(topic: str, root: str) -> Pipeline:
    return Pipeline(
        name="timers",
        source=KafkaSource(topics=(topic,)),
        key_by="user",
        process=TimerEcho(),
        event_time=EventTime(field="ts", allowed_lateness_s=0, idle_timeout_s=None),
        sinks=[ParquetSink("fired", f"{root}/fired")],
        dead_letters=DeadLetterSink(path=f"{root}/dead"),
        checkpoints=f"{root}/checkpoints",
        max_parallelism=8,
        parallelism=2,
    )


def click(user: str, page: str, ts: int = 0, **extra: Any) -> bytes:
    return json.dumps({"user": user, "page": page, "ts": ts, **extra}).encode()


async def slow_tag(record: dict[str, Any]) -> dict[str, Any]:
    """An enrichment that takes 20 ms and tags the record."""
    import asyncio

    await asyncio.sleep(0.02)
    return {**record, "tag": record["page"].upper()}


def slow_operator() -> Any:
    from microbatch.enrich import AsyncOperator, NoRetry

    return AsyncOperator(
        slow_tag, mode="ordered", capacity=4, timeout_s=None, retry=NoRetry(), on_failure="fail"
    )


class CountTags(KeyedProcessFunction):
    """Per user: the tags seen, emitted once per batch with records."""

    def process(self, key: Any, records: Sequence[Any], ctx: ProcessContext) -> None:
        for r in records:
            ctx.emit({"user": key, "offset_tag": r["tag"], "page": r["page"], "ts": r["ts"]})


def enrich_pipeline(topic: str, root: str, deadline_s: float | None) -> Pipeline:
    from microbatch.runtime import Enrichment

    return Pipeline(
        name="enriched",
        source=KafkaSource(topics=(topic,)),
        enrich=Enrichment(slow_operator, deadline_s=deadline_s),
        key_by="user",
        process=CountTags(),
        sinks=[ParquetSink("tags", f"{root}/tags")],
        checkpoints=f"{root}/checkpoints",
        max_parallelism=8,
        parallelism=2,
    )
