"""A keyed step's output on its way: to its sinks through their steps, keyed for the next
step, or a dead letter naming the step when it cannot go on."""

from __future__ import annotations

from typing import Any

import pyarrow as pa
import pytest

from microbatch import windows
from microbatch.dataflow import Dataflow
from microbatch.errors import ProcessError
from microbatch.runtime import (
    DeadLetterSink,
    EventTime,
    KafkaSource,
    KeyedProcessFunction,
    ParquetSink,
)
from microbatch.runtime.envelope import decode_payload
from microbatch.runtime.router import Router


class Echo(KeyedProcessFunction):
    def process(self, key: Any, records: Any, ctx: Any) -> None: ...


def handed_on(r: Router) -> pa.RecordBatch:
    """What the spine hands the next step: the router's records, then its dead letters."""
    return pa.concat_batches([r.record_rows(), r.dead_letter_rows()])


def router(on_error: str = "dead_letter", window: bool = False) -> tuple[Router, list]:
    flow = Dataflow("r", checkpoints="/tmp/r", event_time=EventTime(field="ts"),
                    dead_letters=DeadLetterSink(path="/tmp/r-dead"), max_parallelism=8,
                    parallelism=2, on_process_error=on_error)  # fmt: skip
    first = flow.source(KafkaSource(topics=("t",))).key_by("card").process(Echo(), uid="a")
    first.map(lambda r: {"total": r["total"]}).to(ParquetSink("totals", "/tmp/r-totals"))
    keyed = first.key_by("merchant")
    if window:
        keyed.window(windows.tumbling("1m").count().final(), uid="b").to(ParquetSink("o", "/o"))
    else:
        keyed.process(Echo(), uid="b").to(ParquetSink("o", "/tmp/r-o"))
    dead: list = []
    return Router("w", flow.build(), None, 2, lambda *a, **k: dead.append((a, k))), dead


def test_a_record_goes_to_the_sinks_through_their_steps_and_keyed_to_the_next_step() -> None:
    r, dead = router()
    r.main({"card": "c1", "merchant": "m1", "total": 5, "ts": 7}, key_group=3)
    r.main({"card": "c1", "merchant": "m2", "total": 9, "ts": 8}, key_group=3)
    assert r.outputs == {"totals": [{"total": 5}, {"total": 9}]}
    rows = handed_on(r).to_pylist()
    assert [decode_payload(x["payload"])["merchant"] for x in rows] == ["m1", "m2"]
    coordinates = [(x["topic"], x["partition"], x["offset"]) for x in rows]
    assert coordinates == [("@a>b", 3, 0), ("@a>b", 3, 1)]
    assert [x["event_ts"] for x in rows] == [7, 8] and dead == []


def test_a_record_without_the_next_steps_key_is_a_dead_letter_naming_that_step() -> None:
    r, dead = router()
    r.main({"card": "c1", "total": 5, "ts": 7}, key_group=0)
    (reason, error), _ = dead[0]
    assert reason == "missing_key" and "step 'b'" in error
    assert handed_on(r).num_rows == 0


def test_a_sinks_step_that_raises_is_a_dead_letter_or_fails_the_batch() -> None:
    r, dead = router()
    r.main({"card": "c1", "merchant": "m1", "ts": 7}, key_group=0)  # no "total"
    assert dead[0][0][0] == "step_failed" and "KeyError" in dead[0][0][1]
    assert r.outputs["totals"] == [] and handed_on(r).num_rows == 1  # the next step still
    strict, _ = router(on_error="fail")
    with pytest.raises(ProcessError, match=r"raised KeyError.*on_process_error='dead_letter'"):
        strict.main({"card": "c1", "merchant": "m1", "ts": 7}, key_group=0)


def test_a_window_step_needs_event_time_and_a_window_row_carries_its_own() -> None:
    r, dead = router(window=True)
    r.main({"merchant": "m1", "total": 1}, key_group=0)
    assert dead[0][0][0] == "missing_event_time" and "step 'b'" in dead[0][0][1]
    r.main({"merchant": "m1", "total": 1, "window_end": 60_000}, key_group=0)
    assert handed_on(r).to_pylist()[0]["event_ts"] == 59_999
