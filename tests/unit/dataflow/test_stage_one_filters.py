"""Filters before the first keyed step, in stage 1: a record passes with its source
bytes or leaves no row; a filter that raises dead-letters the record (naming the step)
or fails the batch, as ``on_process_error`` says."""

from __future__ import annotations

import json
from typing import Any

import pytest

from microbatch.dataflow import Dataflow
from microbatch.errors import ProcessError
from microbatch.runtime import DeadLetterSink, EventTime, KafkaSource, KeyedProcessFunction
from microbatch.runtime.envelope import DeadLetterDetail
from microbatch.runtime.stage_one import StageOne
from tests.unit.runtime.test_stage_one import kafka_batch


class Noop(KeyedProcessFunction):
    def process(self, key: Any, records: Any, ctx: Any) -> None:
        pass


def cheap(payment: dict[str, Any]) -> bool:
    return 100 / payment["amount"] > 1  # amount 0 raises ZeroDivisionError


def flow(on_error: str) -> Any:
    f = Dataflow(
        "pay",
        checkpoints="/tmp/x",
        event_time=EventTime("ts"),
        dead_letters=DeadLetterSink(path="/tmp/dl"),
        on_process_error=on_error,  # type: ignore[arg-type]
        max_parallelism=16,
        parallelism=2,
    )
    stream = f.source(KafkaSource(topics=("t",))).filter(lambda p: p["amount"] >= 0)
    stream.filter(cheap, name="cheap").key_by("card").process(Noop(), uid="cards")
    return f.build()


VALUES = [
    json.dumps({"card": "a", "amount": 5, "ts": 1}).encode(),  # kept
    json.dumps({"card": "b", "amount": -3, "ts": 2}).encode(),  # first filter drops it
    json.dumps({"card": "c", "amount": 500, "ts": 3}).encode(),  # second filter drops it
    json.dumps({"card": "d", "amount": 0, "ts": 4}).encode(),  # second filter raises
    json.dumps({"card": "e", "amount": 7, "ts": 5}).encode(),  # kept
]


def test_kept_records_carry_their_source_bytes_and_dropped_ones_leave_no_row() -> None:
    pipeline = flow("dead_letter")
    out = StageOne(pipeline, parallelism=2, watermark=None).envelopes(kafka_batch(VALUES))
    rows = [r for r in out.to_pylist() if r["kind"] != "stat"]
    records = [r for r in rows if r["kind"] == "record"]
    assert [(r["offset"], r["payload"]) for r in records] == [(100, VALUES[0]), (104, VALUES[4])]
    assert [r["event_ts"] for r in records] == [1, 5]
    dead = [r for r in rows if r["kind"] == "dead_letter"]
    assert [r["offset"] for r in dead] == [103]
    detail = DeadLetterDetail.from_payload(dead[0]["payload"])
    assert detail.reason == "step_failed"
    assert "'cheap'" in detail.error and "ZeroDivisionError" in detail.error
    assert detail.raw_value == VALUES[3]


def test_a_raising_filter_fails_the_batch_naming_step_and_record_when_told_to() -> None:
    pipeline = flow("fail")
    with pytest.raises(ProcessError, match=r"'cheap' raised .*ZeroDivisionError.* on t\[1\]@103"):
        StageOne(pipeline, parallelism=2, watermark=None).envelopes(kafka_batch(VALUES))
