"""A dataflow graph's stage 1 routes a run of records at once (``runtime/routed_runs.py``)
and gives exactly the rows of routing them one by one: the same records, keys, key-groups,
instances, event times and payloads along each route, and, when one record could be a
dead letter or fail the batch, the same dead letters (the run falls back as a whole)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from microbatch.dataflow import Dataflow
from microbatch.enrich import AsyncOperator, NoRetry
from microbatch.runtime import (
    DeadLetterSink,
    Enrichment,
    EventTime,
    KafkaSource,
    KeyedProcessFunction,
    ParquetSink,
    Pipeline,
)
from microbatch.runtime.envelope import DeadLetterDetail, EnvelopeBuilder
from microbatch.runtime.graph import marker
from microbatch.runtime.stage_one import StageOne
from tests.unit.runtime.test_stage_one import kafka_batch


class Noop(KeyedProcessFunction):
    def process(self, key: Any, records: Any, ctx: Any) -> None:
        pass


async def tag(record: dict[str, Any]) -> dict[str, Any]:
    return {**record, "risk": len(str(record["merchant"]))}


def tagger() -> AsyncOperator:
    return AsyncOperator(tag, mode="ordered", capacity=10, timeout_s=None, retry=NoRetry(),
                         on_failure="fail")  # fmt: skip


def positive(p: dict[str, Any]) -> bool:
    return 100 // p["amount"] > 0  # amount 0 raises ZeroDivisionError


def graph(*, enrich: bool = False, tap: bool = False) -> Pipeline:
    """no refunds → per card; → cents → per merchant (one branch after a shared filter,
    one after a map of its own)."""
    flow = Dataflow(
        "pay", checkpoints="/tmp/x", event_time=EventTime("ts"),
        dead_letters=DeadLetterSink(path="/tmp/dl"), on_process_error="dead_letter",
        max_parallelism=16, parallelism=2,
    )  # fmt: skip
    source = flow.source(KafkaSource(topics=("t",)))
    if enrich:
        source = source.enrich(Enrichment(tagger))
    payments = source.filter(positive, name="no-refunds")
    if tap:
        payments.to(ParquetSink("all", "/tmp/all"))
    payments.key_by("card").process(Noop(), uid="cards")
    cents = payments.map(lambda p: {**p, "cents": p["amount"] * 100})
    cents.key_by("merchant").process(Noop(), uid="merchants")
    return flow.build()


def payment(i: int, **changes: Any) -> bytes:
    """Odd ``i``: a refund, which the filter drops."""
    amount = (-1) ** i * (i + 1)
    body = {"card": f"c{i % 3}", "merchant": f"m{i % 2}", "amount": amount, "ts": 1_000 + i}
    return json.dumps({**body, **changes}).encode()


def rows(pipeline: Pipeline, values: list[bytes], *, one_by_one: bool, watermark: int | None = None
         ) -> list[dict[str, Any]]:  # fmt: skip
    stage = StageOne(pipeline, parallelism=2, watermark=watermark)
    if one_by_one:
        stage.__dict__["routes_in_runs"] = lambda topic: False  # what it did before runs
    out = stage.envelope_batches(iter([kafka_batch(values)]))
    return [r for batch in out for r in batch.to_pylist()]


def routed(pipeline: Pipeline, values: list[bytes], watermark: int | None = None) -> list:
    """Both ways' rows, each in its own order of the rows (stage 2 sorts them)."""
    key = lambda r: (r["kind"], r["topic"], r["offset"], r["seq"], r["instance"])  # noqa: E731
    runs = sorted(rows(pipeline, values, one_by_one=False, watermark=watermark), key=key)
    each = sorted(rows(pipeline, values, one_by_one=True, watermark=watermark), key=key)
    assert runs == each
    return runs


@pytest.mark.parametrize("enrich", [False, True], ids=["decoded", "enriched"])
def test_a_clean_run_gives_every_routes_rows_of_routing_one_by_one(enrich: bool) -> None:
    values = [payment(i) for i in range(40)] + [payment(40, card=7)]  # an int key too
    out = routed(graph(enrich=enrich), values)

    records = [r for r in out if r["kind"] == "record"]
    assert [r["topic"] for r in records].count("t") == 21  # the even payments, per card
    assert [r["topic"] for r in records].count(marker(0, "merchants", "t")) == 21
    assert [r["event_ts"] for r in records if r["topic"] == "t"] == [
        1_000 + i for i in range(0, 41, 2)
    ]
    assert not [r for r in out if r["kind"] == "dead_letter"]
    stage, n = StageOne(graph(), parallelism=2, watermark=None), len(values)
    records = [json.loads(v) for v in values]
    assert stage.add_run(EnvelopeBuilder(), "t", [1] * n, range(100, 100 + n), [0] * n, records)


@pytest.mark.parametrize(
    ("bad", "reason"),
    [
        (payment(8, card=None), "missing_key"),  # no key for the cards step
        (payment(8, merchant=True), "bad_key"),  # a bool key would collide with 1
        (payment(8, ts="yesterday"), "bad_event_time"),
        (payment(8, amount=0), "step_failed"),  # the shared filter raises
        (b"{not json", "undecodable"),
    ],
    ids=["missing-key", "bool-key", "bad-time", "step-raises", "undecodable"],
)
@pytest.mark.parametrize("enrich", [False, True], ids=["decoded", "enriched"])
def test_a_record_with_a_doubt_makes_the_run_go_one_by_one(
    bad: bytes, reason: str, enrich: bool
) -> None:
    values = [payment(i) for i in range(8)] + [bad] + [payment(i) for i in range(9, 14)]
    out = routed(graph(enrich=enrich), values)

    dead = [r for r in out if r["kind"] == "dead_letter"]
    assert [DeadLetterDetail.from_payload(r["payload"]).reason for r in dead] == [reason]
    assert [r["offset"] for r in dead] == [108]
    assert sum(r["kind"] == "record" for r in out) == 2 * 6  # payments 0, 2, ..., 12


def test_records_behind_the_watermark_are_late_the_same_way() -> None:
    values = [payment(i) for i in range(12)]
    out = routed(graph(), values, watermark=1_006)

    late = [r["offset"] for r in out if r["kind"] == "dead_letter"]
    assert late == [100, 102, 104]  # the even (kept) payments before 1,006
    assert all(r["event_ts"] >= 1_006 for r in out if r["kind"] == "record")


def test_a_sink_before_the_first_keyed_step_keeps_the_one_by_one_path() -> None:
    stage = StageOne(graph(tap=True), parallelism=2, watermark=None)
    assert not stage.routes_in_runs("t")
    assert StageOne(graph(), parallelism=2, watermark=None).routes_in_runs("t")
