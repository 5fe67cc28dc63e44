"""Windows against Spark Structured Streaming: one Kafka topic (two partitions, one running
two minutes behind the other, out-of-order and late events), the same batch boundaries,
the same final windows, batch by batch.

Each phase produces events, then runs one microbatch batch and one ``availableNow`` run
of Structured Streaming per window kind: tumbling count + sum, hopping max, session
count. microbatch uses ``EventTime(watermark="global_max")``, Spark's ``withWatermark``
rule, with ``allowed_lateness_s`` = the watermark delay. The last phase is one far-future
event that closes every window before it.
"""

from __future__ import annotations

import collections
import json
import random
from pathlib import Path
from typing import Any

import pytest

from microbatch import windows
from microbatch.runtime import (
    BatchOptions,
    BatchRunner,
    DeadLetterSink,
    EventTime,
    JsonSchema,
    KafkaSource,
    ParquetSink,
    Pipeline,
)
from microbatch.sinks import read_parquet_sink
from tests.integration.runtime.test_batches import new_topic

pytestmark = pytest.mark.integration
MIN = 60_000
T0 = 1_767_225_600_000  # 2026-01-01T00:00:00Z
DELAY_S = 30
KINDS = {
    # kind: (microbatch process, Spark grouping window, aggregates, output columns)
    "tumbling": (
        lambda: windows.tumbling("1m").count().sum("amount").final(),
        lambda F: F.window("t", "1 minute"),
        lambda F: [F.count("*").alias("count"), F.sum("amount").alias("sum_amount")],
        ("count", "sum_amount"),
    ),
    "hopping": (
        lambda: windows.hopping("2m", every="1m").max("amount").final(),
        lambda F: F.window("t", "2 minutes", "1 minute"),
        lambda F: [F.max("amount").alias("max_amount")],
        ("max_amount",),
    ),
    "session": (
        lambda: windows.session(gap="1m").count().final(),
        lambda F: F.session_window("t", "1 minute"),
        lambda F: [F.count("*").alias("count")],
        ("count",),
    ),
}


def phase_events(seed: int, start: int, n: int) -> list[tuple[int, dict[str, Any]]]:
    """(partition, event): partition 1 runs two minutes behind partition 0; one event in
    three is up to three minutes out of order."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        partition = i % 2
        ts = start + i * 6_000 - partition * 2 * MIN
        if rng.random() < 1 / 3:
            ts -= rng.randrange(3 * MIN)
        event = {"user": f"u{rng.randrange(6)}", "ts": T0 + ts, "amount": rng.randrange(100)}
        out.append((partition, event))
    return out


def late_events(start: int) -> list[tuple[int, dict[str, Any]]]:
    """Far behind any watermark: every window of theirs has closed."""
    return [(i % 2, {"user": f"u{i}", "ts": T0 + start + i * 7_000, "amount": 1}) for i in range(6)]


PHASES = [
    phase_events(1, 0, 80),  # 0 .. 8 min
    phase_events(2, 6 * MIN, 80) + late_events(0),  # 4 .. 14 min, and 0 .. 42 s again
    phase_events(3, 12 * MIN, 40) + late_events(MIN),
    [(0, {"user": "flush", "ts": T0 + 10**9, "amount": 0})],  # closes every window
]


def send(bootstrap: str, topic: str, events: list[tuple[int, dict[str, Any]]]) -> None:
    from kafka import KafkaProducer

    producer = KafkaProducer(bootstrap_servers=bootstrap, acks="all", linger_ms=5)
    try:
        for partition, event in events:
            producer.send(topic, value=json.dumps(event).encode(), partition=partition)
        producer.flush()
    finally:
        producer.close()


#: Declared, the values travel as columns and stage 1 pre-aggregates the windows.
SCHEMA = JsonSchema({"user": "string", "ts": "long", "amount": "long"})


def microbatch_pipeline(kind: str, topic: str, root: Path, declared: bool = False) -> Pipeline:
    return Pipeline(
        name=f"vs-ss-{kind}{'-declared' if declared else ''}",
        source=KafkaSource(topics=(topic,), value_schema=SCHEMA if declared else None),
        key_by="user",
        process=KINDS[kind][0](),
        event_time=EventTime("ts", allowed_lateness_s=DELAY_S, watermark="global_max"),
        sinks=[ParquetSink("out", str(root / "out"))],
        dead_letters=DeadLetterSink(path=str(root / "dead"), max_ratio=1.0),
        checkpoints=str(root / "checkpoints"),
        max_parallelism=16,
        parallelism=2,
    )


def run_structured_streaming(
    spark: Any, bootstrap: str, topic: str, kind: str, checkpoint: Path
) -> list[tuple]:
    """One ``availableNow`` run of the kind's windowed aggregation: the rows it emitted."""
    from pyspark.sql import functions as F

    _, window, aggregates, columns = KINDS[kind]
    events = (
        spark.readStream.format("kafka")
        .option("kafka.bootstrap.servers", bootstrap)
        .option("subscribe", topic)
        .option("startingOffsets", "earliest")
        .load()
        .select(F.from_json(F.col("value").cast("string"), "user STRING, ts LONG, amount LONG")
                .alias("e"))
        .select("e.*", F.timestamp_millis(F.col("e.ts")).alias("t"))
        .withWatermark("t", f"{DELAY_S} seconds")
    )  # fmt: skip
    out = (
        events.groupBy(window(F).alias("w"), "user")
        .agg(*aggregates(F))
        .select(
            F.col("user").alias("key"),
            F.unix_millis("w.start").alias("window_start"),
            F.unix_millis("w.end").alias("window_end"),
            *columns,
        )
    )
    rows: list[tuple] = []
    query = (
        out.writeStream.outputMode("append")
        .foreachBatch(lambda df, _: rows.extend(tuple(r) for r in df.collect()))
        .trigger(availableNow=True)
        .option("checkpointLocation", str(checkpoint))
        .start()
    )
    query.awaitTermination()
    assert query.exception() is None, query.exception()
    return rows


def behind_the_watermark_in_open_windows() -> int:
    """Events older than the watermark their batch starts with (Spark's global one) whose
    1-minute window is still open: both engines count them."""
    watermark, n = None, 0
    for events in PHASES:
        times = [e["ts"] for _, e in events]
        if watermark is not None:
            n += sum(watermark > ts and ts - ts % MIN + MIN > watermark for ts in times)
        watermark = max(watermark or 0, max(times) - DELAY_S * 1000)
    return n


def test_windows_equal_structured_streaming_batch_by_batch(
    spark, kafka_settings, bootstrap, admin, tmp_path: Path
) -> None:
    assert behind_the_watermark_in_open_windows() > 0, "the data has the case that differs"
    topic = new_topic(admin, 2)
    pipelines = {kind: microbatch_pipeline(kind, topic, tmp_path / kind) for kind in KINDS}
    declared = {  # the same windows, pre-aggregated in stage 1: equal to Spark's too
        kind: microbatch_pipeline(kind, topic, tmp_path / f"{kind}-declared", declared=True)
        for kind in KINDS
    }
    ours_declared: dict[str, list[list[tuple]]] = collections.defaultdict(list)
    ours: dict[str, list[list[tuple]]] = collections.defaultdict(list)
    theirs: dict[str, list[list[tuple]]] = collections.defaultdict(list)
    seen: dict[str, set[tuple]] = collections.defaultdict(set)
    for n, events in enumerate(PHASES):
        send(bootstrap, topic, events)
        for kind, pipeline in pipelines.items():
            BatchRunner(spark, pipeline, kafka_settings).run(BatchOptions(run_id=f"p{n}"))
            columns = ("key", "window_start", "window_end", *KINDS[kind][3])
            rows = read_parquet_sink(str(tmp_path / kind / "out")).to_pylist()
            now = {tuple(r[c] for c in columns) for r in rows}
            ours[kind].append(sorted(now - seen[kind]))
            seen[kind] = now
            BatchRunner(spark, declared[kind], kafka_settings).run(BatchOptions(run_id=f"p{n}"))
            rows = read_parquet_sink(str(tmp_path / f"{kind}-declared" / "out")).to_pylist()
            ours_declared[kind].append(sorted({tuple(r[c] for c in columns) for r in rows}))
            ss = run_structured_streaming(spark, bootstrap, topic, kind, tmp_path / f"ss-{kind}")
            theirs[kind].append(sorted(ss))

    for kind in KINDS:
        emitted = [len(rows) for rows in ours[kind]]
        for n, (a, b) in enumerate(zip(ours[kind], theirs[kind], strict=True)):
            only_ours, only_spark = sorted(set(a) - set(b)), sorted(set(b) - set(a))
            assert a == b, f"{kind}, phase {n}: only ours {only_ours}, only Spark's {only_spark}"
        assert sum(emitted) > 20 and emitted[0] and emitted[-1], (kind, emitted)
        cumulative = [sorted({r for rows in ours[kind][: n + 1] for r in rows}) for n in range(4)]
        assert ours_declared[kind] == cumulative, f"{kind}: declared schema, pre-aggregated"
        dead_declared = read_parquet_sink(str(tmp_path / f"{kind}-declared" / "dead"))
        assert dead_declared.num_rows == len(read_parquet_sink(str(tmp_path / kind / "dead")))
        dead = read_parquet_sink(str(tmp_path / kind / "dead")).to_pylist()
        assert {d["reason"] for d in dead} == {"late_window"}, kind
        assert len(dead) >= len(late_events(0)), kind
