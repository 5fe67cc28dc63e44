"""The async operator: the race rules, back-pressure, rate limit, threads, outcomes, snapshots.

Tests wait on events and futures the test controls. Where a test must show that something
does *not* happen (no retry after a timeout), it lets the relevant short delay pass.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest

from microbatch.enrich import (
    AsyncOperator,
    DeadLetter,
    Element,
    FixedDelay,
    NoRetry,
    Output,
    PendingElement,
    Watermark,
    retry_on_result,
)
from microbatch.errors import ConfigError, EnrichmentError


def make(invoke, **options: Any) -> AsyncOperator:
    defaults: dict[str, Any] = {
        "mode": "ordered",
        "capacity": 10,
        "timeout_s": None,
        "retry": NoRetry(),
        "on_failure": "dead_letter",
    }
    return AsyncOperator(invoke, **{**defaults, **options})


def el(i: int, key: Any = None) -> Element:
    return Element(i, ("clicks", 0, i), key)


async def turn(n: int = 10) -> None:
    """Let already-scheduled callbacks run (no wall-clock waiting)."""
    for _ in range(n):
        await asyncio.sleep(0)


def values(items) -> list[Any]:
    return [i.value if isinstance(i, Output) else i for i in items]


class HostileFuture:
    """A client future that reports its outcome as often as the test says (a buggy client).

    It speaks the asyncio future protocol, so the operator awaits it like any future.
    """

    _asyncio_future_blocking = False

    def __init__(self) -> None:
        self.callbacks: list[Any] = []
        self._result: Any = None
        self._exc: BaseException | None = None
        self._done = False

    def fire(self, result: Any = None, exc: BaseException | None = None) -> None:
        self._result, self._exc, self._done = result, exc, True
        for callback in list(self.callbacks):
            callback(self)

    def add_done_callback(self, callback, *, context=None) -> None:
        self.callbacks.append(callback)

    def done(self) -> bool:
        return self._done

    def cancelled(self) -> bool:
        return False

    def cancel(self, msg=None) -> bool:
        return False

    def exception(self) -> BaseException | None:
        return self._exc

    def result(self) -> Any:
        if self._exc is not None:
            raise self._exc
        return self._result

    def get_loop(self):
        return asyncio.get_running_loop()

    def __await__(self):
        yield self
        return self.result()


# Race rules ---------------------------------------------------------------------------


def test_timeout_during_retry_backoff_starts_no_retry():
    calls: list[float] = []

    async def invoke(record):
        calls.append(time.monotonic())
        raise ConnectionError("refused")

    async def main():
        op = make(invoke, timeout_s=0.03, retry=FixedDelay(0.1, max_attempts=5))
        await op.add(el(1))
        assert await op.finish()
        [letter] = op.take_ready()
        await asyncio.sleep(0.15)  # past the retry that was scheduled before the timeout
        return op, letter

    op, letter = asyncio.run(main())

    assert len(calls) == 1
    assert letter == DeadLetter(1, "timeout", letter.error, 1, ("clicks", 0, 1))
    assert op.metrics.retried == 1 and op.metrics.timed_out == 1


def test_late_completion_after_timeout_is_ignored():
    async def main():
        release, returned = asyncio.Event(), asyncio.Event()

        async def invoke(record):
            try:
                await release.wait()
            except asyncio.CancelledError:  # a client that ignores cancellation
                await release.wait()
            returned.set()
            return "late"

        op = make(invoke, timeout_s=0.02)
        await op.add(el(1))
        assert await op.finish()
        first = op.take_ready()
        release.set()
        await returned.wait()
        await turn()
        return op, first, op.take_ready()

    op, first, later = asyncio.run(main())

    assert [type(x) for x in first] == [DeadLetter] and first[0].reason == "timeout"
    assert later == []
    assert op.metrics.late_ignored == 1


def test_late_result_of_a_blocking_call_after_timeout_is_ignored():
    release = threading.Event()

    def invoke(record):
        release.wait(5)
        return "late"

    async def main():
        op = make(invoke, timeout_s=0.02, blocking=True, max_workers=1)
        await op.add(el(1))
        assert await op.finish()
        first = op.take_ready()
        release.set()
        for _ in range(500):  # the thread posts its result back to the loop
            if op.metrics.late_ignored:
                break
            await asyncio.sleep(0.002)
        later = op.take_ready()
        await op.aclose()
        return op, first, later

    op, first, later = asyncio.run(main())

    assert first[0].reason == "timeout" and later == []
    assert op.metrics.late_ignored == 1


def test_double_completing_client_emits_once():
    futures: list[HostileFuture] = []

    def invoke(record):
        futures.append(HostileFuture())
        return futures[-1]

    async def main():
        op = make(invoke)
        await op.add(el(1))
        futures[0].fire(result="first")
        futures[0].fire(result="second")
        futures[0].fire(exc=RuntimeError("third"))
        return op, op.take_ready()

    op, out = asyncio.run(main())

    assert values(out) == ["first"]
    assert op.metrics.late_ignored == 2


def test_completion_after_retry_was_scheduled_is_ignored():
    futures: list[HostileFuture] = []

    def invoke(record):
        futures.append(HostileFuture())
        return futures[-1]

    async def main():
        op = make(invoke, retry=FixedDelay(0.02, max_attempts=3))
        await op.add(el(1))
        futures[0].fire(exc=ConnectionError("reset"))  # → retry scheduled
        futures[0].fire(result="stale")  # the same attempt reports again: dropped
        assert op.take_ready() == [] and op.in_flight == 1
        while len(futures) < 2:
            await asyncio.sleep(0.005)
        futures[1].fire(result="fresh")
        return op, op.take_ready()

    op, out = asyncio.run(main())

    assert values(out) == ["fresh"]
    assert op.metrics.retried == 1 and op.metrics.late_ignored == 1


def test_completion_after_snapshot_is_never_emitted():
    futures: list[HostileFuture] = []

    def invoke(record):
        futures.append(HostileFuture())
        return futures[-1]

    async def main():
        op = make(invoke)
        await op.add(el(1))
        pending = op.snapshot()
        futures[0].fire(result="after the deadline")
        return op, pending, op.take_ready()

    _op, pending, out = asyncio.run(main())

    assert out == [] and [p.record for p in pending] == [1]


# Misbehaving functions ------------------------------------------------------------------


def test_function_that_raises_is_retried_then_dead_lettered_with_attempts():
    calls = []

    async def invoke(record):
        calls.append(record)
        raise ValueError(f"bad record {record}")

    async def main():
        op = make(invoke, retry=FixedDelay(0.0, max_attempts=3))
        await op.add(el(7))
        await op.finish()
        return op.take_ready()

    [letter] = asyncio.run(main())

    assert calls == [7, 7, 7]
    assert (letter.reason, letter.attempts, letter.error) == (
        "error",
        3,
        "ValueError: bad record 7",
    )


def test_function_that_raises_before_awaiting_counts_as_a_failed_attempt():
    def invoke(record):
        raise KeyError(record)

    async def main():
        op = make(invoke)
        await op.add(el(3))
        await op.finish()
        return op.take_ready()

    [letter] = asyncio.run(main())

    assert letter.reason == "error" and letter.attempts == 1


def test_function_that_hangs_times_out_and_is_cancelled():
    cancelled = []

    async def invoke(record):
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.append(record)
            raise

    async def main():
        op = make(invoke, timeout_s=0.02)
        await op.add(el(1))
        await op.finish()
        out = op.take_ready()
        await turn()
        return out

    [letter] = asyncio.run(main())

    assert letter.reason == "timeout" and cancelled == [1]


@pytest.mark.parametrize(
    ("invoke", "blocking", "message"),
    [
        (lambda r: 42, False, "not an awaitable"),
        (lambda r: (x for x in [r]), True, "return a list"),
        (lambda r: {r}, True, "return a list"),
    ],
)
def test_function_returning_the_wrong_type_is_an_invalid_result(invoke, blocking, message):
    async def main():
        op = make(invoke, blocking=blocking, retry=FixedDelay(0.0, 3))
        await op.add(el(1))
        await op.finish()
        out = op.take_ready()
        await op.aclose()
        return out

    [letter] = asyncio.run(main())

    assert letter.reason == "invalid_result" and message in letter.error
    assert letter.attempts == 1  # a programming error is not retried


def test_results_none_list_and_single_value_become_zero_many_and_one_output():
    async def invoke(record):
        return {0: None, 1: [10, 11], 2: (20,), 3: {"v": 3}}[record]

    async def main():
        op = make(invoke)
        for i in range(4):
            await op.add(el(i))
        await op.finish()
        return op.take_ready()

    out = asyncio.run(main())

    assert values(out) == [10, 11, 20, {"v": 3}]
    assert [o.coordinates[2] for o in out] == [1, 1, 2, 3]


def test_retry_on_result_exhausted_emits_the_last_result():
    calls = []

    async def invoke(record):
        calls.append(record)
        return "not ready yet"

    async def main():
        strategy = FixedDelay(0.0, 3, predicates=(retry_on_result(lambda r: r == "not ready yet"),))
        op = make(invoke, retry=strategy)
        await op.add(el(1))
        await op.finish()
        return op, op.take_ready()

    op, out = asyncio.run(main())

    assert values(out) == ["not ready yet"]
    assert len(calls) == 3 and op.metrics.retried == 2


# Failure outcomes -----------------------------------------------------------------------


def test_fail_outcome_raises_with_coordinates_cause_and_attempts():
    async def invoke(record):
        raise ConnectionError("service down")

    async def main():
        op = make(invoke, on_failure="fail", retry=FixedDelay(0.0, 2))
        await op.add(el(7))
        await op.finish()

    with pytest.raises(EnrichmentError) as info:
        asyncio.run(main())

    message = str(info.value)
    assert '"clicks"[0]@7' in message and "2 attempt(s)" in message and "service down" in message
    assert isinstance(info.value.__cause__, ConnectionError)


def test_fail_outcome_on_timeout_stops_further_adds():
    async def invoke(record):
        await asyncio.Event().wait()

    async def main():
        op = make(invoke, on_failure="fail", timeout_s=0.01)
        await op.add(el(1))
        with pytest.raises(EnrichmentError, match="timeout"):
            await op.finish()
        with pytest.raises(EnrichmentError):
            await op.add(el(2))

    asyncio.run(main())


def test_fallback_outcome_emits_the_handler_results_for_timeouts_and_errors():
    async def invoke(record):
        if record == 1:
            await asyncio.Event().wait()
        raise ValueError("nope")

    async def main():
        op = make(
            invoke,
            on_failure="fallback",
            timeout_s=0.02,
            timeout_handler=lambda r: {"fallback": r},
        )
        await op.add(el(1))
        await op.add(el(2))
        await op.finish()
        return op, op.take_ready()

    op, out = asyncio.run(main())

    assert values(out) == [{"fallback": 1}, {"fallback": 2}]
    assert op.metrics.fallbacks == 2 and op.metrics.timed_out == 1 and op.metrics.failed == 1


def test_fallback_handler_that_raises_fails_the_operator():
    async def invoke(record):
        raise ValueError("nope")

    def handler(record):
        raise RuntimeError("handler broken")

    async def main():
        op = make(invoke, on_failure="fallback", timeout_handler=handler)
        await op.add(el(4))
        await op.finish()

    with pytest.raises(EnrichmentError, match="timeout_handler raised"):
        asyncio.run(main())


# Capacity, rate limit, threads ---------------------------------------------------------


def test_add_waits_at_capacity_without_blocking_the_loop():
    async def main():
        gates = {i: asyncio.Event() for i in range(5)}
        running, peak = set(), [0]

        async def invoke(record):
            running.add(record)
            peak[0] = max(peak[0], len(running))
            await gates[record].wait()
            running.discard(record)
            return record

        op = make(invoke, capacity=3)
        for i in range(3):
            await op.add(el(i))
        fourth = asyncio.ensure_future(op.add(el(3)))
        await turn()
        assert not fourth.done() and op.in_flight == 3  # back-pressure
        gates[1].set()  # completes, but waits behind 0 (ordered): still 3 held
        await turn()
        assert not fourth.done()
        gates[0].set()
        await fourth
        assert op.in_flight <= 3
        for gate in gates.values():
            gate.set()
        await op.finish()
        return peak[0], values(op.take_ready())

    peak, out = asyncio.run(main())

    assert peak == 3 and out == [0, 1, 2, 3]


def test_rate_limit_spaces_attempt_starts():
    starts: list[float] = []
    origin: list[float] = []

    async def invoke(record):
        starts.append(asyncio.get_running_loop().time())
        return record

    async def main():
        op = make(invoke, capacity=100, rate_limit_per_s=100.0)
        origin.append(asyncio.get_running_loop().time())  # before the first slot
        for i in range(6):
            await op.add(el(i))
        await op.finish()

    asyncio.run(main())

    # attempt k starts no earlier than its slot, k intervals of 10 ms after the first slot
    # (measured from before it: the first attempt itself may start late on a busy machine)
    assert len(starts) == 6
    for k, started in enumerate(starts):
        assert started - origin[0] >= k * 0.010 - 0.001


def test_blocking_clients_run_concurrently_in_the_thread_pool():
    # Every call waits at the barrier until all eight are running: run one at a time (or
    # fewer than eight at once), the barrier breaks and the calls become dead letters.
    everyone_running = threading.Barrier(8, timeout=30)
    threads: set[str] = set()

    def invoke(record):
        threads.add(threading.current_thread().name)
        everyone_running.wait()
        return record * 2

    async def main():
        op = make(invoke, capacity=8, blocking=True)
        for i in range(8):
            await op.add(el(i))
        await op.finish()
        await op.aclose()
        return op.take_ready()

    out = asyncio.run(main())

    assert values(out) == [i * 2 for i in range(8)], out
    assert len(threads) == 8 and all(name.startswith("microbatch-enrich") for name in threads)


# Snapshot and restore -------------------------------------------------------------------


def test_snapshot_returns_in_flight_and_held_inputs_in_order_and_restore_finishes_them():
    async def first_batch():
        gates = {i: asyncio.Event() for i in range(4)}

        async def invoke(record):
            await gates[record].wait()
            return record

        op = make(invoke, mode="ordered", retry=FixedDelay(0.0, 3))
        for i in range(4):
            await op.add(el(i))
            if i == 1:
                op.add_watermark(100)
        gates[0].set()
        gates[2].set()  # completes but is held behind 1
        await turn()
        emitted = op.take_ready()
        pending = op.snapshot()
        gates[1].set()
        gates[3].set()
        await turn()
        assert op.take_ready() == []  # late results after the snapshot: dropped
        return emitted, pending

    emitted, pending = asyncio.run(first_batch())
    restored = [PendingElement.from_bytes(p.to_bytes()) for p in pending]

    async def second_batch():
        async def invoke(record):
            return record

        op = make(invoke)
        op.restore(restored)
        await op.add(el(4))
        await op.finish()
        return op.take_ready()

    rest = asyncio.run(second_batch())

    assert values(emitted) == [0]
    assert [p.watermark or p.record for p in restored] == [1, 100, 2, 3]
    assert values(rest) == [1, Watermark(100), 2, 3, 4]
    assert restored == pending


def test_snapshot_keeps_failed_attempts_so_retries_are_bounded_across_batches():
    calls = []

    async def invoke(record):
        calls.append(record)
        raise ConnectionError("down")

    async def main(pending):
        op = make(invoke, retry=FixedDelay(0.05, max_attempts=3))
        if pending:
            op.restore(pending)
            await op.finish()
            return op.take_ready()
        await op.add(el(9))
        await turn()
        return op.snapshot()  # after one failed attempt, during the backoff

    pending = asyncio.run(main(None))
    [letter] = asyncio.run(main(pending))

    assert pending[0].attempts == 1 and pending[0].first_attempt_s is not None
    assert letter.attempts == 3 and len(calls) == 3


def test_restore_after_add_is_refused():
    async def invoke(record):
        return record

    async def main():
        op = make(invoke)
        await op.add(el(1))
        with pytest.raises(EnrichmentError, match="before any add"):
            op.restore([PendingElement(2)])
        await op.finish()

    asyncio.run(main())


def test_drain_yields_everything_admitted():
    async def invoke(record):
        await asyncio.sleep(0)
        return record

    async def main():
        op = make(invoke, mode="unordered")
        for i in range(5):
            await op.add(el(i))
        return [item async for item in op.drain()]

    assert sorted(values(asyncio.run(main()))) == [0, 1, 2, 3, 4]


def test_key_of_orders_per_key():
    async def main():
        gates = {i: asyncio.Event() for i in range(3)}

        async def invoke(record):
            await gates[record].wait()
            return record

        op = make(invoke, mode="ordered_per_key", key_of=lambda r: "slow" if r == 0 else "fast")
        for i in range(3):
            await op.add(el(i))
        gates[2].set()
        gates[1].set()
        await turn()
        early = values(op.take_ready())
        gates[0].set()
        await op.finish()
        return early, values(op.take_ready())

    early, late = asyncio.run(main())

    assert early == [1, 2] and late == [0]


@pytest.mark.parametrize(
    "options",
    [
        {"mode": "random"},
        {"on_failure": "ignore"},
        {"capacity": 0},
        {"timeout_s": 0},
        {"rate_limit_per_s": -1},
        {"on_failure": "fallback"},
        {"timeout_handler": lambda r: None},
        {"key_of": lambda r: r},
        {"max_workers": 4},
    ],
)
def test_invalid_configuration_is_refused(options):
    async def invoke(record):
        return record

    with pytest.raises(ConfigError):
        make(invoke, **options)


def test_async_function_with_blocking_true_is_refused():
    async def invoke(record):
        return record

    with pytest.raises(ConfigError, match="plain function"):
        make(invoke, blocking=True)


def test_failed_element_held_behind_the_head_is_redone_without_an_extra_attempt():
    calls: list[int] = []

    async def batch(pending):
        gate = asyncio.Event()

        async def invoke(record):
            calls.append(record)
            if record == 0 and pending is None:
                await gate.wait()  # the head hangs in the first batch
            if record == 1:
                raise ConnectionError("down")
            return record

        op = make(invoke, retry=FixedDelay(0.0, max_attempts=2))
        if pending is None:
            await op.add(el(0))
            await op.add(el(1))
            while calls.count(1) < 2:  # 1 fails twice: dead letter, held behind 0
                await asyncio.sleep(0.001)
            return op.snapshot()
        op.restore(pending)
        await op.finish()
        return op.take_ready()

    pending = asyncio.run(batch(None))
    out = asyncio.run(batch(pending))

    assert [p.attempts for p in pending] == [0, 1]
    assert out[1].attempts == 2 and calls.count(1) == 3


# Eager attempts (results there without waiting) ---------------------------------------


def run_fed(op_options: dict[str, Any], invoke, inputs: list[Any]) -> list[Any]:
    """Feed ``inputs`` (ints or Watermarks) and finish: what the operator emitted."""

    async def main():
        op = make(invoke, **op_options)
        op.feed(el(i) if isinstance(i, int) else i for i in inputs)
        await op.finish()
        return values(op.take_ready())

    return asyncio.run(main())


@pytest.mark.parametrize("mode", ["ordered", "unordered", "ordered_per_key"])
def test_results_ready_at_once_keep_their_mode_order_behind_a_slow_element(mode):
    async def invoke(record):
        if record == 1:
            await asyncio.sleep(0.05)  # the slow one the others overtake where allowed
        return record

    inputs = [*range(200), Watermark(1000), *range(200, 300)]
    key_of = {"key_of": lambda r: r % 2} if mode == "ordered_per_key" else {}
    out = run_fed({"mode": mode, "capacity": 3, **key_of}, invoke, inputs)

    records = [v for v in out if isinstance(v, int)]
    assert sorted(records) == list(range(300)), "each input exactly once"
    watermark_at = out.index(Watermark(1000))
    assert sorted(out[:watermark_at]) == list(range(200)), "nothing crosses the watermark"
    if mode == "ordered":
        assert records == list(range(300))
    elif mode == "unordered":
        assert records.index(1) > records.index(3), "a ready result waited for a slow one"
    else:  # key 1 (odd records) waits for record 1; key 0 (even) does not
        odds = [v for v in records if v % 2]
        assert odds == sorted(odds)
        assert records.index(1) > records.index(4)


def test_an_attempt_runs_in_one_task_from_start_to_end():
    """Attempts started eagerly from another element's outcome still see their own task
    throughout, so task-based timeouts (``asyncio.timeout``, aiohttp's) cancel them and
    nothing else."""
    seen: dict[int, tuple[Any, Any]] = {}

    async def invoke(record):
        before = asyncio.current_task()
        await asyncio.sleep(0)  # a bare yield to the loop (no future) first
        async with asyncio.timeout(5):
            await asyncio.sleep(0.004 if record % 4 == 0 else 0.001)
        seen[record] = (before, asyncio.current_task())
        return record

    # In order, a slow head releases several results at once: several attempts start
    # from one outcome, and only the first may continue in the driver that started it.
    out = run_fed({"mode": "ordered", "capacity": 4}, invoke, list(range(60)))

    assert sorted(out) == list(range(60))
    assert all(before is not None and before is after for before, after in seen.values())


def test_a_timeout_inside_an_eager_attempt_cancels_only_that_attempt():
    async def invoke(record):
        async with asyncio.timeout(0.01 if record == 5 else 5):
            await asyncio.sleep(1 if record == 5 else 0.001)
        return record

    out = run_fed({"mode": "ordered", "capacity": 2}, invoke, list(range(12)))

    assert [v for v in out if isinstance(v, int)] == [i for i in range(12) if i != 5]
    (letter,) = [v for v in out if isinstance(v, DeadLetter)]
    assert letter.record == 5 and "TimeoutError" in letter.error


def test_failures_of_eager_attempts_are_retried_and_dead_lettered_like_any_other():
    calls: dict[int, int] = {}

    async def invoke(record):
        calls[record] = calls.get(record, 0) + 1
        if record % 4 == 0:
            raise ConnectionError(f"down for {record}")  # before any await
        return None if record % 4 == 1 else [record, record]

    out = run_fed(
        {"mode": "ordered", "capacity": 1, "retry": FixedDelay(0.0, max_attempts=2)},
        invoke,
        list(range(8)),
    )

    assert [v.record if isinstance(v, DeadLetter) else v for v in out] == [
        0,
        2,
        2,
        3,
        3,
        4,
        6,
        6,
        7,
        7,
    ]
    assert all(v.attempts == 2 for v in out if isinstance(v, DeadLetter))
    assert calls == {0: 2, 1: 1, 2: 1, 3: 1, 4: 2, 5: 1, 6: 1, 7: 1}


def test_a_function_that_never_waits_still_lets_the_batch_deadline_fire():
    """A run of attempts that complete without suspending yields to the loop now and
    then, so a deadline stops the batch instead of waiting for the whole input."""
    from microbatch.enrich import run_batch

    async def busy(record):  # CPU work, no await: 2 ms each, 4 s for the whole input
        end = time.perf_counter() + 0.002
        while time.perf_counter() < end:
            pass
        return record

    def factory():
        return make(busy, mode="unordered", capacity=4)

    inputs = [el(i) for i in range(2000)]
    outcome = run_batch(factory, inputs, deadline_s=time.time() + 0.3)

    done = [o.value for o in outcome.outputs]
    assert 0 < len(done) < 1000, f"{len(done)} of 2000 done by a 0.3 s deadline"
    assert sorted(done + [p.record for p in outcome.pending]) == list(range(2000))
