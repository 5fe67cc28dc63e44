"""Several sources in one dataflow: each decoded its own way and tagged by its own
steps, merged by union() into one keyed step; one plan reads both topics."""

from __future__ import annotations

import json
from typing import Any

import pyarrow.compute as pc
import pytest

from microbatch.dataflow import Dataflow
from microbatch.errors import ConfigError
from microbatch.runtime import (
    BatchOptions,
    BatchRunner,
    DeadLetterSink,
    JsonSchema,
    KafkaSource,
    KeyedProcessFunction,
    ParquetSink,
)
from microbatch.sinks import read_parquet_sink
from tests.integration.runtime.test_batches import new_topic, produce

pytestmark = pytest.mark.integration


def csv_refund(value: bytes) -> dict[str, Any]:
    customer, amount = value.decode().split(",")
    return {"customer": customer, "amount": int(amount)}


class NetSpend(KeyedProcessFunction):
    def process(self, key: Any, records: Any, ctx: Any) -> None:
        net = ctx.value("net")
        for r in records:
            net.set(net.get(0) + (r["amount"] if r["kind"] == "order" else -r["amount"]))
        ctx.emit({"customer": key, "net": net.get()})


def test_two_sources_meet_in_one_keyed_step(spark, kafka_settings, bootstrap, admin, tmp_path):
    orders_topic, refunds_topic = new_topic(admin, 2), new_topic(admin, 1)
    orders = [json.dumps({"customer": f"u{i % 4}", "amount": 10 + i}).encode() for i in range(40)]
    refunds = [f"u{i % 4},{i}".encode() for i in range(12)] + [b"no-comma"]
    produce(bootstrap, orders_topic, orders)
    produce(bootstrap, refunds_topic, refunds)

    flow = Dataflow(
        "net-spend",
        checkpoints=f"{tmp_path}/checkpoints",
        dead_letters=DeadLetterSink(path=f"{tmp_path}/dead"),
        max_parallelism=8,
        parallelism=2,
    )
    order_stream = flow.source(KafkaSource(topics=(orders_topic,))).map(
        lambda r: {**r, "kind": "order"}
    )
    refund_stream = flow.source(KafkaSource(topics=(refunds_topic,), decoder=csv_refund)).map(
        lambda r: {**r, "kind": "refund"}
    )
    refund_stream.to(ParquetSink("refunds", f"{tmp_path}/refunds"))  # before any keyed step
    order_stream.union(refund_stream).key_by("customer").process(NetSpend(), uid="net").to(
        ParquetSink("net", f"{tmp_path}/net")
    )
    pipeline = flow.build()
    assert set(pipeline.source.topics) == {orders_topic, refunds_topic}

    result = BatchRunner(spark, pipeline, kafka_settings).run(BatchOptions(run_id="one"))
    assert result.records_in == len(orders) + len(refunds)

    want: dict[str, int] = {}
    for v in orders:
        o = json.loads(v)
        want[o["customer"]] = want.get(o["customer"], 0) + o["amount"]
    for v in refunds[:-1]:
        r = csv_refund(v)
        want[r["customer"]] -= r["amount"]
    got = {r["customer"]: r["net"] for r in read_parquet_sink(str(tmp_path / "net")).to_pylist()}
    assert got == want
    dead = read_parquet_sink(str(tmp_path / "dead")).to_pylist()
    assert [(d["reason"], d["topic"]) for d in dead] == [("undecodable", refunds_topic)]
    tapped = read_parquet_sink(str(tmp_path / "refunds")).to_pylist()
    want_refunds = [{**csv_refund(v), "kind": "refund"} for v in refunds[:-1]]
    assert sorted(tapped, key=str) == sorted(want_refunds, key=str)


class Sides(KeyedProcessFunction):
    """A join of two sides: per key, what each side's records hold."""

    def process(self, key: Any, records: Any, ctx: Any) -> None:
        for side, record in records:
            ctx.emit({"customer": key, "side": side, "fields": ",".join(sorted(record)),
                      "amount": record.get("amount")})  # fmt: skip


def test_column_steps_of_two_joined_sources_filter_and_project_each_side(
    spark, kafka_settings, bootstrap, admin, tmp_path
):
    orders_topic, customers_topic = new_topic(admin, 2), new_topic(admin, 1)
    orders = [
        json.dumps({"customer": f"u{i % 4}", "amount": i, "note": "x" * 50}).encode()
        for i in range(40)
    ]
    orders.append(b'{"customer": "u1", "amount": "ten", "note": ""}')  # a schema mismatch
    countries = ["DE", "NL", "DE", "NL"]
    customers = [
        json.dumps({"id": f"u{i}", "country": c, "address": "a"}).encode()
        for i, c in enumerate(countries)
    ]
    produce(bootstrap, orders_topic, orders)
    produce(bootstrap, customers_topic, customers)

    flow = Dataflow(
        "sides",
        checkpoints=f"{tmp_path}/checkpoints",
        dead_letters=DeadLetterSink(path=f"{tmp_path}/dead"),
        max_parallelism=8,
        parallelism=2,
    )
    order_schema = JsonSchema({"customer": "string", "amount": "long", "note": "string"})
    customer_schema = JsonSchema({"id": "string", "country": "string", "address": "string"})
    large = (
        flow.source(KafkaSource(topics=(orders_topic,), value_schema=order_schema))
        .where(pc.field("amount") >= 30)
        .select("customer", "amount")
    )
    dutch = (
        flow.source(KafkaSource(topics=(customers_topic,), value_schema=customer_schema))
        .where(pc.field("country") == "NL")
        .select("id")
    )
    large.key_by("customer").join(dutch.key_by("id"), Sides(), uid="sides").to(
        ParquetSink("out", f"{tmp_path}/out")
    )
    result = BatchRunner(spark, flow.build(), kafka_settings).run(BatchOptions(run_id="one"))

    assert result.records_in == len(orders) + len(customers)
    got = sorted(tuple(r.values()) for r in read_parquet_sink(f"{tmp_path}/out").to_pylist())
    want = sorted([(f"u{i % 4}", 0, "amount,customer", i) for i in range(30, 40)]
                  + [(f"u{i}", 1, "id", None) for i in (1, 3)])  # fmt: skip
    assert got == want
    dead = read_parquet_sink(f"{tmp_path}/dead").to_pylist()
    assert [(d["reason"], d["topic"], d["raw_value"]) for d in dead] == [
        ("schema_mismatch", orders_topic, orders[-1])
    ]
    assert "'amount'" in dead[0]["error"]


def test_a_source_that_feeds_no_keyed_step_is_refused(tmp_path) -> None:
    flow = Dataflow("x", checkpoints=str(tmp_path))
    flow.source(KafkaSource(topics=("a",))).key_by("k").process(NetSpend(), uid="n").to(
        ParquetSink("o", str(tmp_path / "o"))
    )
    flow.source(KafkaSource(topics=("b",)))
    with pytest.raises(ConfigError, match="the source of b feeds no keyed step"):
        flow.build()


def test_sources_read_in_one_plan_must_agree_on_where_to_start(tmp_path) -> None:
    flow = Dataflow("x", checkpoints=str(tmp_path))
    a = flow.source(KafkaSource(topics=("a",)))
    b = flow.source(KafkaSource(topics=("b",), starting="latest"))
    a.union(b).key_by("k").process(NetSpend(), uid="n").to(ParquetSink("o", str(tmp_path)))
    with pytest.raises(ConfigError, match="differ in starting"):
        flow.build()


def test_a_sink_before_the_first_keyed_step_gets_every_record_once(
    spark, kafka_settings, bootstrap, admin, tmp_path
) -> None:
    """An archive of every order (refunds too), fed in stage 1 through its own map, beside
    the keyed step that only sees what the filter keeps; a crash after staging, rerun."""
    topic = new_topic(admin, 2)
    orders = [json.dumps({"customer": f"u{i % 3}", "amount": i - 5}).encode() for i in range(30)]
    produce(bootstrap, topic, orders)
    flow = Dataflow("archive", checkpoints=f"{tmp_path}/checkpoints", max_parallelism=8,
                    parallelism=2)  # fmt: skip
    src = flow.source(KafkaSource(topics=(topic,), max_records_per_batch=20))
    src.map(lambda r: {"customer": r["customer"], "cents": r["amount"] * 100}).to(
        ParquetSink("archive", f"{tmp_path}/archive")
    )
    src.filter(lambda r: r["amount"] > 0).map(lambda r: {**r, "kind": "order"}).key_by(
        "customer"
    ).process(NetSpend(), uid="net").to(ParquetSink("net", f"{tmp_path}/net"))
    pipeline = flow.build()
    BatchRunner(spark, pipeline, kafka_settings).run(BatchOptions(run_id="a"))
    with pytest.raises(Exception, match="injected crash"):
        BatchRunner(spark, pipeline, kafka_settings).run(
            BatchOptions(run_id="b", crash_at="after_sink_staging")
        )
    BatchRunner(spark, pipeline, kafka_settings).run(BatchOptions(run_id="b"))

    archive = read_parquet_sink(str(tmp_path / "archive")).to_pylist()
    want = [{"customer": f"u{i % 3}", "cents": (i - 5) * 100} for i in range(30)]
    assert sorted(archive, key=str) == sorted(want, key=str)
    net: dict[str, int] = {}
    for r in read_parquet_sink(str(tmp_path / "net")).to_pylist():  # running totals: the last
        net[r["customer"]] = max(net.get(r["customer"], 0), r["net"])
    totals: dict[str, int] = {}
    for i in range(30):
        if i - 5 > 0:
            totals[f"u{i % 3}"] = totals.get(f"u{i % 3}", 0) + i - 5
    assert net == totals
