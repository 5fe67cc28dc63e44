"""Enrichment through a real HTTP service: retries on 5xx, timeouts into dead letters."""

from __future__ import annotations

import asyncio
import time

import pytest

from microbatch.enrich import DeadLetter, Element, run_batch

from .conftest import http_operator, operator_factory

pytestmark = pytest.mark.integration


def users(n: int, start: int = 0) -> list[Element]:
    return [Element({"id": i}, ("users", 0, i)) for i in range(start, start + n)]


def test_http_enrichment_retries_5xx_until_it_succeeds(service):
    service.fail_first = 2
    service.latency_s = 0.005

    outcome = run_batch(operator_factory(service.url, max_attempts=3), users(40))

    assert sorted(o.value["id"] for o in outcome.outputs) == list(range(40))
    assert all(o.value["name"] == f"user-{o.value['id']}" for o in outcome.outputs)
    assert set(service.calls.values()) == {3}
    assert outcome.metrics["retried"] == 80 and outcome.dead_letters == []


def test_random_5xx_are_retried_and_exhausted_ones_dead_lettered_once(service):
    service.error_rate = 0.3

    outcome = run_batch(operator_factory(service.url, max_attempts=4), users(100))

    emitted = [o.value["id"] for o in outcome.outputs] + [
        d.record["id"] for d in outcome.dead_letters
    ]
    assert sorted(emitted) == list(range(100))
    assert all(d.attempts == 4 and d.reason == "error" for d in outcome.dead_letters)


def test_slow_endpoint_times_out_into_dead_letters_with_attempts(service):
    service.slow_ids = {3, 4}
    service.error_ids = {7}
    service.latency_s = 0.1  # a 503 after 100 ms, retried until the timeout cuts in

    outcome = run_batch(operator_factory(service.url, timeout_s=0.5, max_attempts=50), users(10))

    letters = {d.record["id"]: d for d in outcome.dead_letters}
    assert sorted(letters) == [3, 4, 7]
    assert all(isinstance(d, DeadLetter) and d.reason == "timeout" for d in letters.values())
    assert letters[3].attempts == 1 and letters[4].attempts == 1
    assert letters[7].attempts >= 2  # failed calls (503 after 100 ms), then the timeout
    assert sorted(o.value["id"] for o in outcome.outputs) == [0, 1, 2, 5, 6, 8, 9]


def test_operator_with_http_client_in_the_callers_loop(service):
    # Ids 0-4 hang in the service until released, and only a task of this loop releases
    # them, once all five requests are in the service at once: the operator must run its
    # capacity of requests concurrently without blocking the loop that drives it.
    service.slow_ids = set(range(5))

    async def release_when_five_are_in_flight() -> list[int]:
        deadline = time.monotonic() + 30
        try:
            while len(service.calls) < 5 and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            return sorted(service.calls)
        finally:
            service.release()

    async def main():
        op = http_operator(service.url, mode="ordered", capacity=5, timeout_s=None)
        releaser = asyncio.create_task(release_when_five_are_in_flight())
        try:
            for element in users(12):
                await op.add(element)
            return await releaser, [item async for item in op.drain()]
        finally:
            releaser.cancel()
            await op.aclose()

    in_flight, out = asyncio.run(main())

    assert in_flight == [0, 1, 2, 3, 4]
    assert [getattr(o, "value", o) for o in out] == [
        {"id": i, "name": f"user-{i}"} for i in range(12)
    ], out
    assert service.calls == {i: 1 for i in range(12)}  # no retry, no second request
