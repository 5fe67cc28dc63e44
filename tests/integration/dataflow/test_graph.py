"""A dataflow that is a graph, not a chain: two keyed steps read one step (a branch), a
source feeds a later step, a union after a keyed step, and a join of two sources that
meet in one keyed step — one Spark job per batch, each step's state its own, through a
crash and a rerun at another parallelism, equal to a plain-Python reference."""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

import pytest

from microbatch.dataflow import Dataflow
from microbatch.runtime import (
    BatchOptions,
    BatchRunner,
    DeadLetterSink,
    KafkaSource,
    KeyedProcessFunction,
)
from microbatch.runtime.process import Sided
from microbatch.sinks import ParquetSink, read_parquet_sink
from tests.integration.runtime.test_batches import new_topic, produce

pytestmark = pytest.mark.integration

ORDERS, PAYMENTS = 60, 20


def order(i: int) -> dict[str, Any]:
    return {"card": f"c{i % 5}", "merchant": f"m{i % 3}", "amount": i + 1}


def payment(i: int) -> dict[str, Any]:
    return {"card": f"c{i % 5}", "paid": 2 * i}


class CardTotal(KeyedProcessFunction):
    """The running total per card, one output per order."""

    def process(self, key: Any, records: Any, ctx: Any) -> None:
        total = ctx.value("total")
        for r in records:
            total.set(total.get(0) + r["amount"])
            ctx.emit({"card": key, "merchant": r["merchant"], "total": total.get()})


class Count(KeyedProcessFunction):
    """How many records each key has had, emitted once per batch."""

    def __init__(self, field: str) -> None:
        self.field = field

    def process(self, key: Any, records: Any, ctx: Any) -> None:
        n = ctx.value("n")
        n.set(n.get(0) + len(records))
        ctx.emit({self.field: key, "n": n.get()})


class Biggest(KeyedProcessFunction):
    def process(self, key: Any, records: Any, ctx: Any) -> None:
        top = ctx.value("top")
        top.set(max([top.get(0), *(r["total"] for r in records)]))
        ctx.emit({"card": key, "top": top.get()})


class SideCounts(KeyedProcessFunction):
    """Orders and payments per card: each record says which side it came in on."""

    def process(self, key: Any, records: Any, ctx: Any) -> None:
        assert all(isinstance(r, Sided) for r in records)
        seen = ctx.value("seen")
        counts = seen.get([0, 0])
        for side, record in records:
            assert ("amount" in record) == (side == 0), record
            if side == 1 and record["paid"] == 0:
                ctx.dead_letter("zero_payment", "a payment of nothing", record)
                continue
            counts[side] += 1
        seen.set(counts)
        ctx.emit({"card": key, "orders": counts[0], "payments": counts[1]})


def graph(tmp_path: Any, orders_topic: str, payments_topic: str) -> Dataflow:
    flow = Dataflow(
        "graph",
        checkpoints=f"{tmp_path}/cp",
        dead_letters=DeadLetterSink(path=f"{tmp_path}/dead"),
        max_parallelism=16,
        parallelism=2,
    )
    out = lambda name: ParquetSink(name, f"{tmp_path}/{name}")  # noqa: E731
    limit = {"max_records_per_batch": 30}
    orders = flow.source(KafkaSource(topics=(orders_topic,), **limit))
    payments = flow.source(KafkaSource(topics=(payments_topic,), **limit))
    totals = orders.key_by("card").process(CardTotal(), uid="totals")
    totals.key_by("merchant").process(Count("merchant"), uid="per-merchant").to(out("merchants"))
    no_card = lambda r: {**r, "card": None} if r["total"] == 1 else r  # noqa: E731
    totals.map(no_card).filter(lambda r: r["total"] > 100 or r["card"] is None).key_by(
        "card"
    ).process(Biggest(), uid="big").to(out("big"))
    entries = totals.map(lambda r: {"card": r["card"]}).union(payments)
    entries.key_by("card").process(Count("card"), uid="ledger").to(out("ledger"))
    orders.key_by("card").join(payments.key_by("card"), SideCounts(), uid="sides").to(out("sides"))
    return flow


def highest(rows: list[dict[str, Any]], key: str, value: str) -> dict[str, Any]:
    best: dict[str, Any] = {}
    for r in rows:
        best[r[key]] = max(best.get(r[key], r[value]), r[value])
    return best


def test_a_graph_of_keyed_steps_equals_the_reference_through_a_crash_and_a_rescale(
    spark, kafka_settings, bootstrap, admin, tmp_path
) -> None:
    orders_topic, payments_topic = new_topic(admin, 2), new_topic(admin, 1)
    produce(bootstrap, orders_topic, [json.dumps(order(i)).encode() for i in range(ORDERS)])
    bad = [b"not json"]
    produce(bootstrap, payments_topic, [json.dumps(payment(i)).encode() for i in range(PAYMENTS)])
    produce(bootstrap, payments_topic, bad)
    pipeline = graph(tmp_path, orders_topic, payments_topic).build()
    assert pipeline.edges, "a graph, not a chain"

    runner = BatchRunner(spark, pipeline, kafka_settings)
    runner.run(BatchOptions(run_id="one"))
    with pytest.raises(Exception, match="injected crash"):
        runner.run(BatchOptions(run_id="two", crash_at="after_sink_staging"))
    runner.run(BatchOptions(run_id="two", parallelism=3))
    runner.run(BatchOptions(run_id="three", parallelism=1))

    orders = [order(i) for i in range(ORDERS)]
    payments = [payment(i) for i in range(PAYMENTS)]
    total: Counter[str] = Counter()
    tops: dict[str, int] = {}
    for o in orders:
        total[o["card"]] += o["amount"]
        if total[o["card"]] > 100:
            tops[o["card"]] = total[o["card"]]
    per_card = Counter(o["card"] for o in orders)
    paid = Counter(p["card"] for p in payments if p["paid"])
    ledger = Counter(o["card"] for o in orders) + Counter(p["card"] for p in payments)

    def read(name: str) -> list[dict[str, Any]]:
        return read_parquet_sink(str(tmp_path / name)).to_pylist()

    assert highest(read("merchants"), "merchant", "n") == Counter(o["merchant"] for o in orders)
    assert highest(read("big"), "card", "top") == tops
    assert highest(read("ledger"), "card", "n") == ledger
    sides = read("sides")
    assert highest(sides, "card", "orders") == per_card
    assert highest(sides, "card", "payments") == paid
    # Each step's records came once: the ledger's counts grow by exactly its batch's records.
    assert len({(r["card"], r["n"]) for r in read("ledger")}) == len(read("ledger"))
    # Dead letters say which step set each aside: none (stage 1), the step whose output
    # had no key for the next one, and a join's own ctx.dead_letter.
    dead = sorted((d["reason"], d["step"], d["topic"]) for d in read("dead"))
    assert dead == [
        ("missing_key", "totals", None),
        ("undecodable", None, payments_topic),
        ("zero_payment", "sides", None),
    ]


def test_a_chain_over_a_declared_schema_reads_its_columns_then_hands_on_records(
    spark, kafka_settings, bootstrap, admin, tmp_path
) -> None:
    """Stage 1 decodes a declared schema into columns for the first keyed step; the
    exchange into it carried only the envelope, so the first step found no columns."""
    from microbatch.runtime.schema import JsonSchema

    topic = new_topic(admin, 2)
    produce(bootstrap, topic, [json.dumps(order(i)).encode() for i in range(ORDERS)])
    schema = JsonSchema({"card": "string", "merchant": "string", "amount": "long"})
    flow = Dataflow("declared", checkpoints=f"{tmp_path}/cp", max_parallelism=16, parallelism=2)
    totals = flow.source(KafkaSource(topics=(topic,), value_schema=schema)).key_by("card")
    per_merchant = totals.process(CardTotal(), uid="totals").key_by("merchant")
    per_merchant.process(Count("merchant"), uid="per-merchant").to(
        ParquetSink("merchants", f"{tmp_path}/merchants")
    )
    BatchRunner(spark, flow.build(), kafka_settings).run(BatchOptions(run_id="one"))
    rows = read_parquet_sink(str(tmp_path / "merchants")).to_pylist()
    want = Counter(order(i)["merchant"] for i in range(ORDERS))
    assert highest(rows, "merchant", "n") == want
