"""The collector paused around bulk work, and frozen only inside Spark tasks."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from microbatch import gcpause
from microbatch.gcpause import freeze_in_spark_worker, gc_paused, paused_while_producing


@pytest.fixture(autouse=True)
def collector_on() -> Iterator[None]:
    was = gc.isenabled()
    gc.enable()
    yield
    if not was:
        gc.disable()


def test_the_collector_is_off_inside_and_back_on_after() -> None:
    with gc_paused():
        assert not gc.isenabled()
    assert gc.isenabled()


def test_a_pause_inside_a_pause_leaves_the_collector_off_until_the_outer_one_ends() -> None:
    with gc_paused():
        with gc_paused():
            pass
        assert not gc.isenabled(), "the inner pause switched the collector back on"
    assert gc.isenabled()


def test_the_collector_comes_back_on_when_the_work_raises() -> None:
    with pytest.raises(ValueError), gc_paused():
        raise ValueError("boom")
    assert gc.isenabled()


def test_only_the_producer_runs_without_the_collector() -> None:
    seen_by_producer: list[bool] = []

    def produce() -> Iterator[int]:
        for i in range(3):
            seen_by_producer.append(gc.isenabled())
            yield i

    seen_by_caller = [(item, gc.isenabled()) for item in paused_while_producing(produce())]

    assert seen_by_caller == [(0, True), (1, True), (2, True)]
    assert seen_by_producer == [False, False, False]
    assert gc.isenabled()


def test_an_error_of_the_producer_reaches_the_caller_with_the_collector_on() -> None:
    def produce() -> Iterator[int]:
        yield 1
        raise RuntimeError("broker gone")

    items = paused_while_producing(produce())
    assert next(items) == 1
    with pytest.raises(RuntimeError, match="broker gone"):
        next(items)
    assert gc.isenabled()


def test_stopping_early_closes_the_producer_at_once() -> None:
    closed: list[bool] = []

    def produce() -> Iterator[int]:
        try:
            yield from range(10)
        finally:
            closed.append(True)  # a reader closes its Kafka consumer here

    producer = produce()  # still referenced: only an explicit close runs its finally now
    items = paused_while_producing(producer)
    assert next(items) == 0
    items.close()

    assert closed == [True]
    assert gc.isenabled()


def test_nothing_is_frozen_outside_a_spark_task(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gcpause, "_frozen", False)
    before = gc.get_freeze_count()

    freeze_in_spark_worker()

    assert gc.get_freeze_count() == before
    assert gcpause._frozen is False
