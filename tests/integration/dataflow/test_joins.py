"""Joins of two Kafka topics in one dataflow, on real Kafka and Spark. Interval joins and
a window join: out of order, over several batches, through a crash and rescales 2→3→1,
their output equals Spark's join of the same rows (inner and full outer; the same 20 s
window), pair for pair — windows that close in their records' own batch and windows that
wait in state across batches alike; a temporal (as-of) join, which Spark has not, equals
a plain-Python as-of lookup. Each with ``select=fields(...)`` too, whose every key the
executors join on Arrow columns. A table join
of a changelog topic with real tombstones (null values), read by each reader, equals a
plain-Python KTable; so does one of declared schemas with ``select=fields(...)``, which
Spark's executors join on Arrow columns."""

from __future__ import annotations

import json
import random
from collections import Counter
from typing import Any

import pytest

from microbatch.checkpoint import Layout, latest_manifest
from microbatch.dataflow import Dataflow
from microbatch.joins import IntervalJoin, TableJoin, TemporalJoin, WindowJoin, fields
from microbatch.runtime import (
    BatchOptions,
    BatchRunner,
    DeadLetterSink,
    EventTime,
    JsonSchema,
    KafkaSource,
)
from microbatch.runtime.records import BatchRecord
from microbatch.sinks import ParquetSink, read_parquet_sink
from microbatch.storage import open_store
from tests.integration.runtime.test_batches import new_topic, produce

pytestmark = pytest.mark.integration

BASE = 1_700_000_000_000
FLUSH = BASE + 10_000_000  # far past every record: the watermark then drops all state


def events(seed: int = 5) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Orders and payments out of order by up to 3 s (the allowed lateness is 5 s)."""
    rng = random.Random(seed)
    orders = [
        {"oid": i, "card": f"c{i % 7}", "ts": BASE + i * 1_000 + rng.randint(-3_000, 3_000)}
        for i in range(160)
    ]
    payments = [
        {"pid": j, "card": f"c{j % 7}", "ts": BASE + j * 1_500 + rng.randint(-3_000, 3_000)}
        for j in range(100)
    ]
    return orders, payments


def flush(bootstrap: str, topic: str, partitions: int, record: dict[str, Any]) -> None:
    """A record far in the future in every partition: the watermark (the slowest
    partition's) then passes every record, and the joins drop all they hold."""
    from kafka import KafkaProducer

    producer = KafkaProducer(bootstrap_servers=bootstrap, acks="all")
    try:
        for p in range(partitions):
            producer.send(topic, json.dumps(record).encode(), partition=p).get(30)
    finally:
        producer.close()


def pairs(rows: list[dict[str, Any]]) -> Counter[tuple[Any, Any]]:
    """(order id, payment id) of each output row; None for a missing side."""
    return Counter((r.get("oid"), r.get("pid")) for r in rows if r.get("card") != "flush")


INTERVAL = "p.ts BETWEEN o.ts - 2000 AND o.ts + 2000"
SAME_WINDOW = "floor(o.ts / 20000) = floor(p.ts / 20000)"  # tumbling 20 s, epoch-aligned


def spark_pairs(
    spark, orders, payments, how: str, when: str = INTERVAL
) -> Counter[tuple[Any, Any]]:
    o = spark.createDataFrame([(r["oid"], r["card"], r["ts"]) for r in orders], "oid long, "
                              "card string, ts long").alias("o")  # fmt: skip
    p = spark.createDataFrame([(r["pid"], r["card"], r["ts"]) for r in payments], "pid long, "
                              "card string, ts long").alias("p")  # fmt: skip
    on = f"o.card = p.card AND {when}"
    from pyspark.sql import functions as F

    joined = o.join(p, F.expr(on), how).select(
        F.coalesce("o.card", "p.card").alias("card"), "oid", "pid"
    )
    return pairs([r.asDict() for r in joined.collect()])


def test_joins_equal_sparks_or_the_as_of_reference_through_a_crash_and_rescales(
    spark, kafka_settings, bootstrap, admin, tmp_path
) -> None:
    orders, payments = events()
    orders_topic, payments_topic = new_topic(admin, 2), new_topic(admin, 1)
    produce(bootstrap, orders_topic, [json.dumps(r).encode() for r in orders])
    produce(bootstrap, payments_topic, [json.dumps(r).encode() for r in payments])
    flush(bootstrap, orders_topic, 2, {"oid": -1, "card": "flush", "ts": FLUSH})
    flush(bootstrap, payments_topic, 1, {"pid": -1, "card": "flush", "ts": FLUSH})

    flow = Dataflow(
        "joins",
        checkpoints=f"{tmp_path}/cp",
        # Flink's watermark (the slowest partition's): no record of this data is late.
        event_time=EventTime(field="ts", allowed_lateness_s=5, idle_timeout_s=None),
        dead_letters=DeadLetterSink(path=f"{tmp_path}/dead"),
        max_parallelism=16,
        parallelism=2,
    )
    limit = {"max_records_per_batch": 120}
    o = flow.source(KafkaSource(topics=(orders_topic,), **limit)).key_by("card")
    p = flow.source(KafkaSource(topics=(payments_topic,), **limit)).key_by("card")
    for how in ("inner", "full"):
        join = IntervalJoin("ts", "ts", between=(-2_000, 2_000), how=how)
        o.join(p, join, uid=f"join-{how}").to(ParquetSink(how, f"{tmp_path}/{how}"))
    windowed = WindowJoin("ts", "ts", "20s")
    o.join(p, windowed, uid="join-window").to(ParquetSink("window", f"{tmp_path}/window"))
    # The inner, full outer and window joins naming their output: they join on columns.
    named = fields(left=["oid", "card"], right=["pid"])
    o.join(p, IntervalJoin("ts", "ts", between=(-2_000, 2_000), select=named),
           uid="join-columns").to(ParquetSink("columns", f"{tmp_path}/columns"))  # fmt: skip
    o.join(p, WindowJoin("ts", "ts", "20s", select=named), uid="join-window-columns").to(
        ParquetSink("window_columns", f"{tmp_path}/window_columns")
    )
    full_named = IntervalJoin("ts", "ts", between=(-2_000, 2_000), how="full", select=named)
    o.join(p, full_named, uid="join-full-columns").to(
        ParquetSink("full_columns", f"{tmp_path}/full_columns")
    )
    # Each order with the card's latest payment at its time (as of), by dicts and on columns.
    for name, select in (("asof", lambda a, b: named(a, b)), ("asof_columns", named)):
        as_of = TemporalJoin("ts", "ts", "1m", how="left", select=select)
        o.join(p, as_of, uid=f"join-{name}").to(ParquetSink(name, f"{tmp_path}/{name}"))
    pipeline = flow.build()

    runner = BatchRunner(spark, pipeline, kafka_settings)
    counters: Counter[str] = Counter()
    runner.run(BatchOptions(run_id="r0"))
    counters += counters_of(pipeline, kafka_settings)
    with pytest.raises(Exception, match="injected crash"):
        runner.run(BatchOptions(run_id="r1", crash_at="after_state_files"))
    runner.run(BatchOptions(run_id="r1", parallelism=3))
    counters += counters_of(pipeline, kafka_settings)
    for i in (2, 3):  # the rest, then one more: the flush moved the watermark past all
        runner.run(BatchOptions(run_id=f"r{i}", parallelism=1))
        counters += counters_of(pipeline, kafka_settings)
    for step in ("join-columns", "join-full-columns", "join-window-columns", "join-asof_columns"):
        assert counters[f"{step}.keys_as_columns"] == counters[f"{step}.keys"] > 0, counters
    assert not any(k.endswith("keys_as_columns") for k in counters if k.startswith(
        ("join-inner.", "join-full.", "join-window.", "join-asof.")))  # fmt: skip

    sinks = ("inner", "full", "window", "columns", "window_columns", "full_columns", "asof",
             "asof_columns")  # fmt: skip
    got = {name: read_parquet_sink(str(tmp_path / name)).to_pylist() for name in sinks}
    inner = spark_pairs(spark, orders, payments, "inner")
    assert sum(inner.values()) > 50, "the data should join often"
    assert pairs(got["inner"]) == inner
    assert pairs(got["full"]) == spark_pairs(spark, orders, payments, "full")
    same_window = spark_pairs(spark, orders, payments, "inner", SAME_WINDOW)
    assert sum(same_window.values()) > 50, "the data should share windows often"
    assert pairs(got["window"]) == same_window
    assert pairs(got["columns"]) == pairs(got["inner"])
    assert pairs(got["window_columns"]) == same_window
    full_columns = Counter((r["oid"], r["pid"]) for r in got["full_columns"] if -1 not in
                           (r["oid"], r["pid"]))  # fmt: skip
    assert full_columns == pairs(got["full"])
    assert any(oid is None for oid, _ in full_columns) and any(p is None for _, p in full_columns)
    as_of = as_of_reference(orders, payments)
    assert sum(1 for _, pid in as_of if pid is None) >= 3, "some orders have no payment yet"
    assert pairs(got["asof"]) == as_of
    assert pairs(got["asof_columns"]) == as_of
    assert read_parquet_sink(str(tmp_path / "dead")).num_rows == 0
    row = next(r for r in got["inner"] if r["card"] != "flush")
    assert set(row) >= {"oid", "pid", "card", "ts", "ts_right"}


def counters_of(pipeline, settings) -> Counter[str]:
    """The instance counters of the pipeline's last committed batch, summed."""
    manifest = latest_manifest(open_store(pipeline.checkpoints, settings), Layout())
    stats = BatchRecord.of(manifest).stats
    counters: Counter[str] = Counter()
    for instance in stats.instances if stats else ():
        counters.update(instance.counters)
    return counters


def as_of_reference(orders, payments) -> Counter[tuple[Any, Any]]:
    """Each order with the payment of its card latest at or before its time (None: none
    yet), whatever the batches."""
    out: Counter[tuple[Any, Any]] = Counter()
    for o in orders:
        before = [(p["ts"], p["pid"]) for p in payments if p["card"] == o["card"] and
                  p["ts"] <= o["ts"]]  # fmt: skip
        out[o["oid"], max(before)[1] if before else None] += 1
    return out


def changelog_batches() -> list[tuple[list[tuple[str, dict[str, Any] | None]], list[dict]]]:
    """Per batch: the customers changelog as (Kafka key, value or None: a tombstone), and
    the orders. Deletes, re-creations and updates of keys the orders then look up."""

    def row(cid: str, city: str) -> tuple[str, dict[str, Any]]:
        return cid, {"id": cid, "city": city}

    return [
        ([row("c1", "Oslo"), row("c2", "Rome"), row("c3", "Lima"), row("c2", "Pune"),
          ("c1", None), ("c9", None)],
         [{"oid": i, "customer": f"c{i % 5}"} for i in range(10)]),
        ([("c2", None), row("c3", "Kyiv"), ("c4", None), row("c4", "Baku"), row("c1", "Oslo")],
         [{"oid": i, "customer": f"c{i % 5}"} for i in range(10, 20)]),
    ]  # fmt: skip


def ktable_reference(batches) -> Counter[tuple[int, str | None]]:
    """Kafka Streams' left KStream-KTable join, a batch's changes before its orders."""
    table: dict[str, dict[str, Any]] = {}
    out: Counter[tuple[int, str | None]] = Counter()
    for changes, orders in batches:
        for key, value in changes:
            if value is None:
                table.pop(key, None)
            else:
                table[key] = value
        for order in orders:
            out[order["oid"], table.get(order["customer"], {}).get("city")] += 1
    return out


def order_city(order: dict[str, Any], row: dict[str, Any] | None) -> dict[str, Any]:
    """The same fields in every output row (a Parquet file's schema is its first row's)."""
    return {"oid": order["oid"], "city": None if row is None else row["city"]}


@pytest.mark.parametrize("reader", ["python", "spark"])
def test_table_join_deletes_on_real_tombstones_of_a_changelog_topic(
    spark, kafka_settings, bootstrap, admin, tmp_path, reader
) -> None:
    from kafka import KafkaProducer

    orders_topic, customers_topic = new_topic(admin, 1), new_topic(admin, 1)
    flow = Dataflow(
        f"changelog-{reader}",
        checkpoints=f"{tmp_path}/cp",
        dead_letters=DeadLetterSink(path=f"{tmp_path}/dead"),
        max_parallelism=16,
        parallelism=2,
    )
    read = {"reader": reader, "consumer_config": {"fetch_max_wait_ms": 20}}  # to each reader
    orders = flow.source(KafkaSource(topics=(orders_topic,), **read))
    customers = flow.source(KafkaSource(topics=(customers_topic,), tombstones=True, **read))
    join = TableJoin(how="left", select=order_city)
    orders.key_by("customer").join(customers.key_by("id"), join, uid="t").to(
        ParquetSink("out", f"{tmp_path}/out")
    )
    runner = BatchRunner(spark, flow.build(), kafka_settings)

    batches = changelog_batches()
    producer = KafkaProducer(bootstrap_servers=bootstrap, acks="all")
    try:
        for i, (changes, orders_of_batch) in enumerate(batches):
            for key, value in changes:  # value None: a real tombstone (a null Kafka value)
                body = None if value is None else json.dumps(value).encode()
                producer.send(customers_topic, key=key.encode(), value=body)
            for order in orders_of_batch:
                producer.send(orders_topic, value=json.dumps(order).encode())
            producer.flush()
            runner.run(BatchOptions(run_id=f"r{i}"))
            assert runner.stage_one_reader == reader
    finally:
        producer.close()

    rows = read_parquet_sink(str(tmp_path / "out")).to_pylist()
    got = Counter((r["oid"], r["city"]) for r in rows)
    expected = ktable_reference(batches)
    assert got == expected
    assert sum(1 for _, city in expected if city is None) >= 8, "deletes should show"
    assert read_parquet_sink(str(tmp_path / "dead")).num_rows == 0


def test_a_table_join_of_declared_sources_runs_on_columns_and_equals_the_ktable(
    spark, kafka_settings, bootstrap, admin, tmp_path
) -> None:
    from kafka import KafkaProducer

    orders_topic, customers_topic = new_topic(admin, 2), new_topic(admin, 1)
    flow = Dataflow(
        "changelog-columns",
        checkpoints=f"{tmp_path}/cp",
        dead_letters=DeadLetterSink(path=f"{tmp_path}/dead"),
        max_parallelism=16,
        parallelism=2,
    )
    orders = flow.source(
        KafkaSource(
            topics=(orders_topic,), value_schema=JsonSchema({"oid": "long", "customer": "string"})
        )
    )
    customers = flow.source(
        KafkaSource(
            topics=(customers_topic,), value_schema=JsonSchema({"id": "string", "city": "string"})
        )
    )
    join = TableJoin(how="left", select=fields(left=["oid"], right=["city"]))
    orders.key_by("customer").join(customers.key_by("id"), join, uid="t").to(
        ParquetSink("out", f"{tmp_path}/out")
    )
    pipeline = flow.build()
    runner = BatchRunner(spark, pipeline, kafka_settings)
    # updates only: a tombstone is no row of a schema (it takes the records path)
    batches = [([(k, v) for k, v in changes if v is not None], orders_of_batch)
               for changes, orders_of_batch in changelog_batches()]  # fmt: skip
    producer = KafkaProducer(bootstrap_servers=bootstrap, acks="all")
    try:
        for i, (changes, orders_of_batch) in enumerate(batches):
            for key, value in changes:
                producer.send(customers_topic, key=key.encode(), value=json.dumps(value).encode())
            for order in orders_of_batch:
                producer.send(orders_topic, value=json.dumps(order).encode())
            producer.flush()
            runner.run(BatchOptions(run_id=f"r{i}", parallelism=3 if i else None))
    finally:
        producer.close()

    rows = read_parquet_sink(str(tmp_path / "out")).to_pylist()
    assert Counter((r["oid"], r["city"]) for r in rows) == ktable_reference(batches)
    manifest = latest_manifest(open_store(pipeline.checkpoints, kafka_settings), Layout())
    stats = BatchRecord.of(manifest).stats
    counters: Counter[str] = Counter()
    for instance in stats.instances if stats else ():
        counters.update(instance.counters)
    assert counters["keys_as_columns"] == counters["keys"] > 0, counters  # every key on columns
