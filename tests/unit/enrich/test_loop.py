"""run_batch: the synchronous way in, with deadlines that turn unfinished work into pending."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from microbatch.enrich import (
    AsyncOperator,
    Element,
    NoRetry,
    PendingElement,
    Watermark,
    new_event_loop,
    run_batch,
)
from microbatch.errors import EnrichmentError

SLOW = {3}


def factory(slow_s: float = 0.0, on_failure: str = "dead_letter", capacity: int = 4):
    calls: list[int] = []

    def make() -> AsyncOperator:
        asyncio.get_running_loop()  # the factory runs inside the batch's loop

        async def invoke(record: int) -> Any:
            calls.append(record)
            if record in SLOW:
                await asyncio.sleep(slow_s)
            if record == 13:
                raise ValueError("unlucky")
            return record * 10

        return AsyncOperator(
            invoke,
            mode="ordered",
            capacity=capacity,
            timeout_s=None,
            retry=NoRetry(),
            on_failure=on_failure,
        )

    make.calls = calls  # type: ignore[attr-defined]
    return make


def elements(n: int) -> list[Element]:
    return [Element(i, ("t", 1, i)) for i in range(n)]


def test_new_event_loop_prefers_uvloop():
    loop = new_event_loop()
    try:
        assert type(loop).__module__.startswith("uvloop")
    finally:
        loop.close()


def test_run_batch_without_deadline_emits_everything():
    outcome = run_batch(factory(), [*elements(3), Watermark(5), *elements(20)[13:15]])

    assert [getattr(o, "value", o) for o in outcome.outputs] == [0, 10, 20, Watermark(5), 140]
    assert [d.record for d in outcome.dead_letters] == [13]
    assert outcome.pending == [] and outcome.metrics["completed"] == 4


def test_deadline_turns_in_flight_held_and_unstarted_inputs_into_pending():
    first = run_batch(factory(slow_s=5.0), elements(10), deadline_s=time.time() + 0.2)
    make = factory()
    second = run_batch(make, [], pending=first.pending)

    assert [o.value for o in first.outputs] == [0, 10, 20]
    assert [p.record for p in first.pending] == list(range(3, 10))
    assert first.pending[0].first_attempt_s is not None  # 3 was in flight
    assert first.pending[-1].first_attempt_s is None  # 9 never started (capacity 4)
    assert [o.value for o in second.outputs] == [i * 10 for i in range(3, 10)]
    assert make.calls == list(range(3, 10))


def test_deadline_already_passed_calls_nothing_and_hands_everything_on():
    make = factory()
    restored = [PendingElement(1, ("t", 1, 1), attempts=1)]

    outcome = run_batch(make, elements(3), pending=restored, deadline_s=time.time() - 1)

    assert make.calls == []
    assert outcome.pending == [restored[0], *(PendingElement.of(e) for e in elements(3))]


def test_pending_survives_a_codec_round_trip_between_batches():
    first = run_batch(factory(slow_s=5.0), elements(6), deadline_s=time.time() + 0.2)
    blobs = [p.to_bytes() for p in first.pending]

    second = run_batch(factory(), [], pending=[PendingElement.from_bytes(b) for b in blobs])

    values = [o.value for o in first.outputs + second.outputs]
    assert values == [i * 10 for i in range(6)]


def test_run_batch_raises_the_operator_failure():
    with pytest.raises(EnrichmentError, match=r'"t"\[1\]@13'):
        run_batch(factory(on_failure="fail"), elements(15))
