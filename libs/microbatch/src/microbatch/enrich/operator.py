"""The async I/O operator: many enrichment calls in flight, results emitted exactly once.

The asyncio event loop is the mailbox (seed 003): admissions, attempt completions,
timeouts, retries, emission and snapshots all run as callbacks on the loop thread, so
queue and element state need no locks. Blocking clients run in a thread pool and their
results come back to the loop through ``asyncio.wrap_future`` (``call_soon_threadsafe``).

Per element, the order of events is decided by one rule: **the first outcome wins**.
An element is settled exactly once — by a result, by its last failure, or by its
timeout — and every attempt carries a token; a completion whose token is stale (its
element settled, a retry was scheduled after it, or the operator was snapshotted) is
counted in ``metrics.late_ignored`` and dropped. A timeout cancels any scheduled retry,
and a retry re-checks the element before starting, so no attempt starts after a timeout.

Attempts start **eagerly** inside a driver task (see ``_drive``): a new element's
coroutine runs at once up to its first suspension, in the task that then awaits the
rest of it. A result that is there without suspending (an in-process lookup, a cache hit)
and that its queue would emit at once skips the queue altogether — no entry, no task, no
timer — which makes the operator's cost per such element a few Python calls. A run of
eager attempts yields to the loop after ``_EAGER_SLICE_S``, so timers and deadlines still
fire even when the function never waits.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
import types
from collections import deque
from collections.abc import (
    AsyncIterator,
    Awaitable,
    Callable,
    Coroutine,
    Hashable,
    Iterable,
    Iterator,
)
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from types import CoroutineType
from typing import Any, Literal

from microbatch.enrich.elements import (
    DeadLetter,
    Element,
    Output,
    PendingElement,
    Watermark,
    where,
)
from microbatch.enrich.metrics import EnrichMetrics
from microbatch.enrich.queues import Entry, KeyOrderedQueue, OrderedQueue, UnorderedQueue
from microbatch.enrich.retry import RetryStrategy, may_retry_results
from microbatch.errors import ConfigError, EnrichmentError

log = logging.getLogger(__name__)

Mode = Literal["ordered", "unordered", "ordered_per_key"]
OnFailure = Literal["fail", "fallback", "dead_letter"]

_QUEUES = {"ordered": OrderedQueue, "unordered": UnorderedQueue, "ordered_per_key": KeyOrderedQueue}
_ON_FAILURE = ("fail", "fallback", "dead_letter")


_STALE = asyncio.CancelledError("stale attempt")  # marker: cancelled by the operator
_EAGER_SLICE_S = 0.01  # longest run of eager admissions between two loop steps
_SCALARS = frozenset({int, float, str, bytes, bool, dict})


class _InvalidResult(Exception):
    """The enrichment function returned something the operator cannot emit."""


def _normalize(value: Any) -> list[Any]:
    """None → no result, list/tuple → many, anything else → one."""
    if value is None:
        return []
    kind = type(value)
    if kind is list or kind is tuple:
        return list(value)
    if kind in _SCALARS:
        return [value]
    if isinstance(value, list | tuple):
        return list(value)
    if inspect.isawaitable(value):
        raise _InvalidResult(
            f"the function returned an awaitable ({type(value).__name__}) as its result: "
            "a blocking=True function must be a plain function"
        )
    if isinstance(value, Iterator | set | frozenset):
        raise _InvalidResult(
            f"the function returned a {type(value).__name__}: return a list for many results"
        )
    return [value]


class _Item(Entry):
    """Queue entry with the operator's per-element state (loop thread only)."""

    __slots__ = (
        "admitted_at",
        "base",
        "call",
        "coro",
        "element",
        "failures",
        "first_attempt_s",
        "in_flight",
        "outputs",
        "retry_handle",
        "started",
        "task",
        "timed_out",
        "timer",
        "token",
        "ts",
    )

    def __init__(self, seq: int, *, key: Hashable = None, is_watermark: bool = False) -> None:
        super().__init__(seq, key=key, is_watermark=is_watermark)
        self.element: Element | None = None
        self.ts: int | float | None = None
        self.failures = 0  # attempts that ended in a failure, across batches
        self.base = 0  # failures before the latest attempt started
        self.timed_out = False
        self.first_attempt_s: float | None = None
        self.admitted_at = 0.0  # loop clock, for timers
        self.started = 0.0  # perf_counter, for latency (uvloop's clock has ms steps)
        self.in_flight = False
        self.token = 0
        self.task: asyncio.Future[Any] | None = None
        self.call: Future[Any] | None = None  # the thread-pool call of a blocking attempt
        self.coro: Coroutine[Any, Any, Any] | None = None  # the attempt driven by ``task``
        self.timer: asyncio.TimerHandle | None = None
        self.retry_handle: asyncio.Handle | None = None
        self.outputs: list[Any] = []

    def cancel_pending_work(self) -> None:
        """Stop the timer, any scheduled retry and the running attempt; stale its token."""
        self.token += 1
        for handle in (self.timer, self.retry_handle):
            if handle is not None:
                handle.cancel()
        self.timer = self.retry_handle = None
        if self.call is not None and not self.call.cancel():
            pass  # already running in a thread: it cannot be stopped; its result is stale
        elif self.task is not None and not self.task.done():
            self.task.cancel()
            if self.coro is not None and inspect.getcoroutinestate(self.coro) == "CORO_CREATED":
                self.coro.close()  # cancelled before it ran: nothing to unwind, no warning
        self.task = self.call = self.coro = None


class AsyncOperator:
    """Calls ``invoke`` for many elements concurrently and emits results in ``mode`` order.

    - ``mode``: ``"ordered"`` (input order), ``"unordered"`` (completion order within
      watermark segments) or ``"ordered_per_key"`` (input order within a key, keys free;
      the key is ``key_of(record)``, else ``Element.key``).
    - ``capacity``: most records admitted and not yet emitted; :meth:`add` waits beyond.
    - ``timeout_s``: per element, from admission, covering every attempt, retry delay
      and rate-limit wait. ``None`` disables it.
    - ``retry``: a strategy from :mod:`microbatch.enrich.retry`.
    - ``on_failure``: what a timed-out or finally failed element becomes — ``"fail"``
      (the operator raises :class:`EnrichmentError`), ``"fallback"`` (the results of
      ``timeout_handler(record)``, used for timeouts *and* errors) or ``"dead_letter"``
      (one :class:`DeadLetter`).
    - ``rate_limit_per_s``: attempts (first calls and retries) start at most this often,
      evenly spaced.
    - ``blocking``: ``invoke`` is a plain function, run in a pool of ``max_workers``
      threads (default: ``capacity``). Running calls cannot be cancelled; their late
      results are dropped.

    ``invoke(record)`` returns (or, when async, resolves to) ``None`` for no result, a
    list/tuple for many, anything else for one. Inputs come in through ``await add()``
    (a producer coroutine) or ``feed(iterable)`` (pulled as room frees up) — use one of
    the two. Use the operator from one event loop only; an ``invoke`` object with an
    async ``aclose()`` is closed by :meth:`aclose`.
    """

    def __init__(
        self,
        invoke: Callable[[Any], Awaitable[Any]] | Callable[[Any], Any],
        *,
        mode: Mode,
        capacity: int,
        timeout_s: float | None,
        retry: RetryStrategy,
        on_failure: OnFailure,
        timeout_handler: Callable[[Any], Any] | None = None,
        key_of: Callable[[Any], Hashable] | None = None,
        rate_limit_per_s: float | None = None,
        blocking: bool = False,
        max_workers: int | None = None,
    ) -> None:
        if mode not in _QUEUES:
            raise ConfigError(f"unknown mode {mode!r}: use one of {sorted(_QUEUES)}")
        if on_failure not in _ON_FAILURE:
            raise ConfigError(f"unknown on_failure {on_failure!r}: use one of {list(_ON_FAILURE)}")
        if not isinstance(capacity, int) or capacity < 1:
            raise ConfigError(f"capacity must be an int >= 1, got {capacity!r}")
        if timeout_s is not None and not timeout_s > 0:
            raise ConfigError(f"timeout_s must be > 0 seconds or None, got {timeout_s!r}")
        if rate_limit_per_s is not None and not rate_limit_per_s > 0:
            raise ConfigError(f"rate_limit_per_s must be > 0 or None, got {rate_limit_per_s!r}")
        if on_failure == "fallback" and timeout_handler is None:
            raise ConfigError("on_failure='fallback' needs a timeout_handler(record)")
        if on_failure != "fallback" and timeout_handler is not None:
            raise ConfigError(
                f"timeout_handler is only used with on_failure='fallback', not {on_failure!r}"
            )
        if key_of is not None and mode != "ordered_per_key":
            raise ConfigError(f"key_of is only used with mode='ordered_per_key', not {mode!r}")
        if blocking and _is_async(invoke):
            raise ConfigError("blocking=True needs a plain function, got an async one")
        if max_workers is not None and (not blocking or max_workers < 1):
            raise ConfigError(f"max_workers={max_workers!r} needs blocking=True and must be >= 1")
        if not hasattr(retry, "next_delay"):
            raise ConfigError(f"retry must be a RetryStrategy, got {retry!r}")
        self._invoke = invoke
        self._mode = mode
        self._capacity = capacity
        self._timeout_s = timeout_s
        self._retry = retry
        self._may_retry_results = may_retry_results(retry)  # else skip asking per result
        self._on_failure = on_failure
        self._timeout_handler = timeout_handler
        self._key_of = key_of
        self._interval = None if rate_limit_per_s is None else 1.0 / rate_limit_per_s
        self._blocking = blocking
        self._max_workers = max_workers or capacity
        self._queue = _QUEUES[mode]()
        self._executor: ThreadPoolExecutor | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._seq = 0
        self._next_slot = 0.0
        self._ready: list[Output | DeadLetter | Watermark] = []
        self._waiters: list[asyncio.Future[None]] = []
        self._failure: Exception | None = None
        self._closed = False
        self._last_watermark: int | float | None = None
        self._source: Iterator[Element | Watermark] | None = None
        self._pulling = False
        self._driving = False  # a driver task is handling an outcome right now
        self._handoff: deque[tuple[_Item, int, Coroutine[Any, Any, Any]]] = deque()
        self._eager = not blocking and self._interval is None
        self._slice_end = 0.0  # perf_counter time at which an eager pull pauses
        self._paused = False  # an eager pull stopped to let the loop run; its driver resumes
        self.metrics = EnrichMetrics()

    # Admission ------------------------------------------------------------------------

    def try_add(self, element: Element) -> bool:
        """Admit ``element`` if below capacity (True); never waits. Loop thread only."""
        self._check_usable()
        loop = self._bind()
        if len(self._queue) >= self._capacity:
            return False
        self._admit(loop, element, failures=0, first_attempt_s=None)
        return True

    async def add(self, element: Element) -> None:
        """Admit ``element``, waiting (without blocking the loop) while at capacity."""
        while not self.try_add(element):
            await self._wait_change(None)

    async def wait_for_space(self, deadline: float | None = None) -> bool:
        """Wait until a record can be admitted (True) or ``deadline`` passes (False).

        ``deadline`` is wall-clock ``time.time()`` seconds, like every deadline here.
        """
        while len(self._queue) >= self._capacity:
            self._check_usable()
            if deadline is not None and time.time() >= deadline:
                return False
            await self._wait_change(deadline)
        self._check_usable()
        return True

    def add_watermark(self, ts: int | float) -> None:
        """Insert a watermark after everything admitted so far (not counted in capacity).

        A watermark not above the previous one carries no information and is dropped.
        """
        self._check_usable()
        self._bind()
        if self._last_watermark is not None and ts <= self._last_watermark:
            return
        self._last_watermark = ts
        item = _Item(self._next_seq(), is_watermark=True)
        item.ts = ts
        self._queue.add(item)
        self._emit()

    def feed(self, inputs: Iterable[Element | Watermark]) -> None:
        """Pull inputs from ``inputs`` whenever there is room, until it is exhausted.

        The mailbox way in: the loop admits the next input in the same step that emits
        one, so no producer coroutine has to wake up. :meth:`finish` then also waits for
        the input to run out; :meth:`detach_input` returns what was never pulled.
        """
        self._check_usable()
        self._bind()
        if self._source is not None:
            raise EnrichmentError("feed() was already called and its input is not exhausted")
        self._source = iter(inputs)
        self._pull()

    def detach_input(self) -> Iterator[Element | Watermark]:
        """The inputs :meth:`feed` has not pulled yet (e.g. after a deadline snapshot)."""
        source, self._source = self._source, None
        return source if source is not None else iter(())

    def restore(self, pending: Iterable[PendingElement]) -> None:
        """Re-issue a snapshot's inputs first, in their original order, with their state.

        Call before any other input. Restored records are admitted even beyond
        ``capacity`` (a snapshot holds at most the previous capacity). Each gets a fresh
        timeout budget — a batch deadline is not the element's fault — while its failed
        attempts carry over, so ``max_attempts`` bounds the calls across batches.
        """
        self._check_usable()
        loop = self._bind()
        if self._seq:
            raise EnrichmentError("restore() must come before any add()/add_watermark()")
        for p in pending:
            if p.watermark is not None:
                self.add_watermark(p.watermark)
            else:
                element = Element(p.record, p.coordinates, p.key)
                self._admit(loop, element, failures=p.attempts, first_attempt_s=p.first_attempt_s)

    # Output ---------------------------------------------------------------------------

    def take_ready(self) -> list[Output | DeadLetter | Watermark]:
        """Everything emitted since the last call, in emission order."""
        self._raise_failure()
        out, self._ready = self._ready, []
        return out

    async def drain(self) -> AsyncIterator[Output | DeadLetter | Watermark]:
        """Yield emitted items as they come until every admitted input was emitted."""
        while True:
            for item in self.take_ready():
                yield item
            if not len(self._queue):
                return
            self._check_usable()
            await self._wait_change(None)

    async def finish(self, deadline: float | None = None) -> bool:
        """Wait until every admitted input was emitted (True) or ``deadline`` passed (False).

        ``deadline`` is wall-clock ``time.time()`` seconds. Raises the operator's failure.
        """
        while len(self._queue) or self._source is not None:
            self._check_usable()
            if deadline is not None and time.time() >= deadline:
                return False
            await self._wait_change(deadline)
        self._raise_failure()
        return True

    def snapshot(self) -> list[PendingElement]:
        """Stop, and return every input not yet emitted, in original order.

        In-flight and completed-but-not-emitted records, and watermarks still waiting,
        are returned with their retry state; anything that completes later is dropped.
        Collect what was emitted before with :meth:`take_ready`. The operator is closed.
        """
        self._raise_failure()
        self._emit()
        pending: list[PendingElement] = []
        for entry in self._queue.pending():
            assert isinstance(entry, _Item)
            if entry.is_watermark:
                pending.append(PendingElement(watermark=entry.ts))
            else:
                e = entry.element
                assert e is not None
                # Settled by an attempt but not emitted: that attempt is redone on restore,
                # so it must not count (else a last failed attempt would be one too many).
                redo = entry.done and not entry.timed_out
                attempts = entry.base if redo else entry.failures
                pending.append(
                    PendingElement(e.record, e.coordinates, e.key, attempts, entry.first_attempt_s)
                )
        self.close()
        return pending

    def close(self) -> None:
        """Cancel timers, retries and running attempts; late results are dropped."""
        if self._closed:
            return
        self._closed = True
        for entry in self._queue.pending():
            if isinstance(entry, _Item):
                entry.cancel_pending_work()
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
        self._notify()

    async def aclose(self, grace_s: float = 0.1) -> None:
        """:meth:`close`, let cancelled attempts unwind, then ``await invoke.aclose()``."""
        tasks = [
            e.task
            for e in self._queue.pending()
            if isinstance(e, _Item) and e.task is not None and not e.task.done()
        ]
        self.close()
        if tasks:
            await asyncio.wait(tasks, timeout=grace_s)
        closer = getattr(self._invoke, "aclose", None)
        if closer is not None and _is_async(closer):
            await closer()

    @property
    def in_flight(self) -> int:
        """Records admitted and not yet emitted."""
        return len(self._queue)

    @property
    def failure(self) -> Exception | None:
        """What stopped the operator (``on_failure="fail"``, or a raising input), if any."""
        return self._failure

    # Attempts (loop thread) -----------------------------------------------------------

    def _admit(
        self,
        loop: asyncio.AbstractEventLoop,
        element: Element,
        *,
        failures: int,
        first_attempt_s: float | None,
    ) -> None:
        key = self._key(element)
        item = self._enqueue(loop, element, key, time.perf_counter(), failures, first_attempt_s)
        if self._interval is None:
            self._start_attempt(item)
        else:
            self._schedule_attempt(item)

    def _key(self, element: Element) -> Hashable:
        if self._key_of is None:
            return element.key
        try:
            return self._key_of(element.record)
        except Exception as e:
            raise EnrichmentError(f"key_of raised for {where(element.coordinates)}: {e!r}") from e

    def _enqueue(
        self,
        loop: asyncio.AbstractEventLoop,
        element: Element,
        key: Hashable,
        started: float,
        failures: int = 0,
        first_attempt_s: float | None = None,
    ) -> _Item:
        """Queue ``element`` in input order and start its timeout; no attempt yet."""
        seq = self._seq
        self._seq = seq + 1
        item = _Item(seq, key=key)
        item.element = element
        item.failures = failures
        item.first_attempt_s = first_attempt_s
        item.started = started
        self._queue.add(item)
        self.metrics.in_flight = len(self._queue)
        if self._timeout_s is not None:
            item.admitted_at = loop.time()
            item.timer = loop.call_at(item.admitted_at + self._timeout_s, self._on_timeout, item)
        return item

    def _admit_eagerly(
        self, loop: asyncio.AbstractEventLoop, element: Element, started: float
    ) -> None:
        """Admit a new element by running its attempt up to its first suspension, here.

        Only from a driver task with nothing handed off: if the attempt suspends, that
        driver goes on with it next, so the function runs in one task from start to end
        (``asyncio.current_task()``, and the timeouts built on it, stay right). A result
        there without suspending that the queue would emit at once skips the queue.
        """
        key = self._key(element)
        try:
            attempt = self._invoke(element.record)
        except Exception as e:  # raised before returning an awaitable: the attempt failed
            item = self._enqueue(loop, element, key, started)
            self._begin(item)
            item.in_flight = False
            self._on_error(item, e)
            return
        if type(attempt) is not CoroutineType:  # a future, or another coroutine type
            item = self._enqueue(loop, element, key, started)
            self._follow(item, self._begin(item), attempt)
            return
        try:
            waiting_on = attempt.send(None)
        except StopIteration as stop:
            if not self._emit_at_once(element, key, stop.value, started):
                item = self._enqueue(loop, element, key, started)
                self._outcome(item, self._begin(item), value=stop.value)
            return
        except (Exception, asyncio.CancelledError) as e:
            item = self._enqueue(loop, element, key, started)
            self._outcome(item, self._begin(item), error=e)
            return
        item = self._enqueue(loop, element, key, started)
        token = self._begin(item)
        item.coro = attempt
        self._handoff.append((item, token, _resumed(attempt, waiting_on)))

    def _emit_at_once(self, element: Element, key: Hashable, value: Any, started: float) -> bool:
        """Emit a result that needs no queueing (False: queue it as usual)."""
        if self._may_retry_results or not self._queue.emits_at_once(key):
            return False
        if type(value) in _SCALARS:  # one result: what _normalize says, minus a list
            self._ready.append(Output(value, element.coordinates))
        else:
            try:
                results = _normalize(value)
            except _InvalidResult:
                return False
            coordinates = element.coordinates
            self._ready.extend([Output(v, coordinates) for v in results])
        self._seq += 1  # its place in the input order, as if queued
        self.metrics.completed += 1
        self.metrics.observe_latency(time.perf_counter() - started)
        if self._waiters:
            self._notify()
        return True

    def _schedule_attempt(self, item: _Item) -> None:
        """Start an attempt now, or at the next rate-limit slot."""
        item.retry_handle = None
        if self._interval is not None:
            assert self._loop is not None
            now = self._loop.time()
            slot = max(now, self._next_slot)
            self._next_slot = slot + self._interval
            if slot > now:
                item.retry_handle = self._loop.call_at(slot, self._start_attempt, item)
                return
        self._start_attempt(item)

    def _begin(self, item: _Item) -> int:
        """Mark an attempt of ``item`` as started; its token."""
        item.token += 1
        item.base = item.failures
        item.in_flight = True
        if item.first_attempt_s is None:
            item.first_attempt_s = time.time()
        return item.token

    def _start_attempt(self, item: _Item) -> None:
        item.retry_handle = None
        if item.done or self._closed:  # timed out or snapshotted while waiting: no attempt
            return
        assert self._loop is not None and item.element is not None
        token = self._begin(item)
        record = item.element.record
        try:
            if not self._blocking:
                self._follow(item, token, self._invoke(record))
                return
            item.call = self._pool().submit(self._invoke, record)
            future = asyncio.wrap_future(item.call, loop=self._loop)
        except Exception as e:  # raised before any await: the attempt failed
            item.in_flight = False
            self._on_error(item, e)
            return
        item.task = future
        future.add_done_callback(partial(self._on_attempt_done, item, token))

    def _follow(self, item: _Item, token: int, attempt: Any) -> None:
        """See the attempt ``invoke`` returned through to its outcome."""
        assert self._loop is not None
        if type(attempt) is CoroutineType or inspect.iscoroutine(attempt):
            # The common case: drive the coroutine in our own task, so its outcome is
            # handled in the same loop step (no extra done-callback round).
            item.coro = attempt
            if self._driving:  # a driver task will run it right after this step
                self._handoff.append((item, token, attempt))
            else:
                item.task = self._loop.create_task(self._drive(item, token, attempt))
            return
        try:
            if not inspect.isawaitable(attempt):
                raise _InvalidResult(
                    f"invoke returned {type(attempt).__name__}, not an awaitable: define "
                    "it with `async def`, or pass blocking=True for a plain function"
                )
            future = asyncio.ensure_future(attempt)
        except Exception as e:
            item.in_flight = False
            self._on_error(item, e)
            return
        item.task = future
        future.add_done_callback(partial(self._on_attempt_done, item, token))

    async def _drive(self, item: _Item, token: int, coro: Coroutine[Any, Any, Any]) -> None:
        """Run attempts in this task: this one, then any it started (see ``_handoff``).

        Like a worker, a driver that settles an element and thereby admits the next
        input runs that input's attempt right away in the same loop step, instead of
        creating a task that starts one step later. Cancellation always lands on the
        attempt being awaited, since it is delivered at the task's next step.
        """
        task = asyncio.current_task()
        assert task is not None
        while True:
            value: Any = None
            error: BaseException | None = None
            try:
                value = await coro
            except asyncio.CancelledError:
                if not (self._closed or item.done or token != item.token):
                    cancelled = asyncio.CancelledError("the attempt was cancelled")
                    self._outcome(item, token, error=cancelled)
                    raise  # cancelled by someone else: end this task as cancelled
                task.uncancel()  # cancelled by us (timeout, snapshot): nothing to report
                if self._closed:
                    return
                error = _STALE
            except Exception as e:
                error = e
            if error is not _STALE:
                self._driving = True
                self._slice_end = time.perf_counter() + _EAGER_SLICE_S
                try:
                    self._outcome(item, token, value=value, error=error)
                finally:
                    self._driving = False
            while self._paused and not self._handoff:
                # An eager pull ran for a whole slice without giving the loop a chance:
                # let timers and deadlines fire, then pull on from this task.
                self._paused = False
                await asyncio.sleep(0)
                self._driving = True
                self._slice_end = time.perf_counter() + _EAGER_SLICE_S
                try:
                    self._pull()
                finally:
                    self._driving = False
            if not self._handoff:
                return
            item, token, coro = self._handoff.popleft()
            item.task = task
            while self._handoff:
                other, other_token, other_coro = self._handoff.popleft()
                other.task = asyncio.ensure_future(self._drive(other, other_token, other_coro))

    def _on_attempt_done(self, item: _Item, token: int, future: asyncio.Future[Any]) -> None:
        """Done-callback of future-style attempts (thread-pool calls, client futures)."""
        if future.cancelled():
            if not (self._closed or item.done or token != item.token):
                self._outcome(item, token, error=asyncio.CancelledError("cancelled"))
            return
        error = future.exception()  # also marks it retrieved
        if error is not None:
            self._outcome(item, token, error=error)
        else:
            self._outcome(item, token, value=future.result())

    def _outcome(
        self, item: _Item, token: int, value: Any = None, error: BaseException | None = None
    ) -> None:
        """The single entry point of attempt outcomes: stale ones are dropped here."""
        if self._closed or item.done or token != item.token:
            self.metrics.late_ignored += 1
            return
        item.task = item.call = item.coro = None
        item.in_flight = False
        if error is not None:
            retryable = False if isinstance(error, asyncio.CancelledError) else None
            self._on_error(item, error, retryable)
            return
        try:
            results = _normalize(value)
            retry_result = self._may_retry_results and self._retry.retries_result(value)
        except Exception as e:
            self._on_error(item, e, False)
            return
        if retry_result:
            item.failures += 1
            if self._try_retry(item):
                return
        self.metrics.completed += 1
        coordinates = item.element.coordinates if item.element else None
        self._settle(item, [Output(v, coordinates) for v in results])

    def _on_error(self, item: _Item, exc: BaseException, retryable: bool | None = None) -> None:
        item.failures += 1
        if retryable is None and not isinstance(exc, _InvalidResult):
            try:
                retryable = self._retry.retries_exception(exc)
            except Exception as e:
                exc, retryable = e, False
        if retryable and self._try_retry(item):
            return
        self.metrics.failed += 1
        reason = "invalid_result" if isinstance(exc, _InvalidResult) else "error"
        self._fail_element(item, reason, exc, item.failures)

    def _try_retry(self, item: _Item) -> bool:
        delay = self._retry.next_delay(item.failures)
        if delay is None:
            return False
        assert self._loop is not None
        item.token += 1  # whatever the finished attempt still reports is stale now
        self.metrics.retried += 1
        item.retry_handle = self._loop.call_later(delay, self._schedule_attempt, item)
        return True

    def _on_timeout(self, item: _Item) -> None:
        item.timer = None
        if item.done or self._closed:
            return
        self.metrics.timed_out += 1
        item.timed_out = True
        attempts = item.failures + (1 if item.in_flight else 0)
        item.in_flight = False
        item.cancel_pending_work()  # cancels a scheduled retry: none starts after this
        error = TimeoutError(f"no result within timeout_s={self._timeout_s}")
        self._fail_element(item, "timeout", error, attempts)

    def _fail_element(self, item: _Item, reason: str, exc: BaseException, attempts: int) -> None:
        element = item.element
        assert element is not None
        place = where(element.coordinates, item.seq)
        if self._on_failure == "fail":
            self._set_failure(
                EnrichmentError(
                    f"enrichment of {place} failed ({reason}) after {attempts} attempt(s): "
                    f"{exc!r}. Fix the service or the function, or choose "
                    "on_failure='dead_letter' to keep going."
                ),
                exc,
            )
            return
        if self._on_failure == "fallback":
            assert self._timeout_handler is not None
            try:
                results = _normalize(self._timeout_handler(element.record))
            except Exception as e:
                self._set_failure(
                    EnrichmentError(f"timeout_handler raised for {place} ({reason}): {e!r}"), e
                )
                return
            self.metrics.fallbacks += 1
            self._settle(item, [Output(v, element.coordinates) for v in results])
            return
        self.metrics.dead_lettered += 1
        letter = DeadLetter(
            element.record,
            reason,
            f"{type(exc).__name__}: {exc}",
            attempts,
            element.coordinates,
            item.first_attempt_s,
        )
        self._settle(item, [letter])

    def _settle(self, item: _Item, outputs: list[Any]) -> None:
        """The element's one and only outcome: hand it to the queue and emit."""
        assert self._loop is not None
        if item.timer or item.retry_handle or item.task or item.call:
            item.cancel_pending_work()
        else:  # nothing to cancel (the common case): only stale any late report
            item.token += 1
            item.coro = None
        item.in_flight = False
        item.outputs = outputs
        self.metrics.observe_latency(time.perf_counter() - item.started)
        self._queue.complete(item)
        self._emit()

    def _emit(self) -> None:
        ready = self._queue.pop_ready()
        if not ready:
            return
        out = self._ready
        for entry in ready:
            assert isinstance(entry, _Item)
            if entry.is_watermark:
                assert entry.ts is not None
                out.append(Watermark(entry.ts))
            else:
                out.extend(entry.outputs)
                entry.outputs = []
        self.metrics.in_flight = len(self._queue)
        self._notify()
        if self._source is not None:
            self._pull()

    def _pull(self) -> None:
        """Admit inputs from the fed iterator while below capacity (not re-entrant)."""
        if self._pulling:
            return  # an admission settled synchronously; the outer loop keeps pulling
        self._pulling = True
        try:
            assert self._loop is not None
            while self._source is not None and not self._closed:
                if len(self._queue) >= self._capacity:
                    return
                eager = self._eager and self._driving and not self._handoff
                if eager:
                    started = time.perf_counter()
                    if started > self._slice_end:
                        self._paused = True  # the driver yields to the loop, then pulls on
                        return
                try:
                    item = next(self._source)
                except StopIteration:
                    self._source = None
                    self._notify()
                    return
                if isinstance(item, Watermark):
                    self.add_watermark(item.ts)
                elif eager:
                    self._admit_eagerly(self._loop, item, started)
                else:
                    self._admit(self._loop, item, failures=0, first_attempt_s=None)
        except Exception as e:  # the input iterator (or key_of) raised
            self._source = None
            self._set_failure(e)
        finally:
            self._pulling = False

    def _set_failure(self, error: Exception, cause: BaseException | None = None) -> None:
        if cause is not None:
            error.__cause__ = cause
        if self._failure is None:
            log.error("%s", error)
            self._failure = error
        self.close()

    # Plumbing -------------------------------------------------------------------------

    def _bind(self) -> asyncio.AbstractEventLoop:
        loop = asyncio.get_running_loop()
        if self._loop is None:
            self._loop = loop
        elif loop is not self._loop:
            raise EnrichmentError("an AsyncOperator must be used from one event loop only")
        return loop

    def _next_seq(self) -> int:
        seq = self._seq
        self._seq += 1
        return seq

    def _pool(self) -> ThreadPoolExecutor:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(
                max_workers=self._max_workers, thread_name_prefix="microbatch-enrich"
            )
        return self._executor

    def _raise_failure(self) -> None:
        if self._failure is not None:
            raise self._failure

    def _check_usable(self) -> None:
        self._raise_failure()
        if self._closed:
            raise EnrichmentError(
                "the operator was snapshotted or closed: create a new one and restore() "
                "the pending inputs"
            )

    async def _wait_change(self, deadline: float | None) -> None:
        """Wait until something is emitted, the operator stops, or ``deadline`` passes."""
        assert self._loop is not None
        waiter = self._loop.create_future()
        self._waiters.append(waiter)
        timer = None
        if deadline is not None:
            timer = self._loop.call_later(max(0.0, deadline - time.time()), _wake, waiter)
        try:
            await waiter
        finally:
            if timer is not None:
                timer.cancel()

    def _notify(self) -> None:
        if not self._waiters:
            return
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            _wake(waiter)


@types.coroutine
def _resumed(attempt: Coroutine[Any, Any, Any], waiting_on: Any) -> Any:
    """Await ``attempt``, whose first step already ran and suspended on ``waiting_on``.

    What ``await attempt`` would do from there: pass each suspension up to the task and
    what the task sends or throws (a cancellation) down to the attempt.
    """
    while True:
        try:
            sent = yield waiting_on
        except GeneratorExit:
            attempt.close()
            raise
        except BaseException as e:
            try:
                waiting_on = attempt.throw(e)
            except StopIteration as stop:
                return stop.value
        else:
            try:
                waiting_on = attempt.send(sent)
            except StopIteration as stop:
                return stop.value


def _wake(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


def _is_async(fn: Any) -> bool:
    """True for ``async def`` functions, partials of them and objects with ``async __call__``."""
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
        getattr(type(fn), "__call__", None)  # noqa: B004 - async callable objects
    )
