"""The async I/O operator: many enrichment calls in flight, results emitted exactly once.

The asyncio event loop is the mailbox (seed 003): admissions, attempt completions,
timeouts, retries, emission and snapshots all run as callbacks on the loop thread, so
queue and element state need no locks. Blocking clients run in a thread pool and their
results come back to the loop through ``asyncio.wrap_future`` (``call_soon_threadsafe``).

This module is the public face: it checks the settings, admits inputs (added or fed),
snapshots and closes. Each element's life is an :class:`~.lifecycle.ElementState`;
:mod:`.emission` queues elements in their mode's order and emits them, :mod:`.attempts`
starts and drives their calls (eagerly: a result ready at once may skip the queue), and
:mod:`.failures` decides what outcomes, failures and timeouts lead to — the first
outcome wins, exactly once.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Hashable, Iterable, Iterator
from typing import Any, Literal

from microbatch.enrich.attempts import AttemptDriver
from microbatch.enrich.elements import DeadLetter, Element, Output, PendingElement, Watermark, where
from microbatch.enrich.emission import Emitter
from microbatch.enrich.failures import ON_FAILURE, FailurePolicy, OnFailure
from microbatch.enrich.lifecycle import TrackedEntry
from microbatch.enrich.metrics import EnrichMetrics
from microbatch.enrich.queues import KeyOrderedQueue, OrderedQueue, UnorderedQueue
from microbatch.enrich.retry import RetryStrategy, may_retry_results
from microbatch.errors import ConfigError, EnrichmentError

log = logging.getLogger(__name__)

Mode = Literal["ordered", "unordered", "ordered_per_key"]

_QUEUES = {"ordered": OrderedQueue, "unordered": UnorderedQueue, "ordered_per_key": KeyOrderedQueue}


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
        if on_failure not in ON_FAILURE:
            raise ConfigError(f"unknown on_failure {on_failure!r}: use one of {list(ON_FAILURE)}")
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
        self._capacity = capacity
        self._key_of = key_of
        self._failure: Exception | None = None
        self._last_watermark: int | float | None = None
        self._source: Iterator[Element | Watermark] | None = None
        self._pulling = False
        self.metrics = EnrichMetrics()
        # The queue side, the attempts and the failure policy. Attempts report to the
        # policy, which settles elements through the emitter and retries through the
        # driver; the emitter's timeouts go to the policy too.
        self._queue = _QUEUES[mode]()
        self._emitter = Emitter(
            self._queue,
            metrics=self.metrics,
            timeout_s=timeout_s,
            may_retry_results=may_retry_results(retry),
            pull=self._pull,
        )
        self._attempts = AttemptDriver(
            invoke,
            blocking=blocking,
            max_workers=max_workers or capacity,
            interval=None if rate_limit_per_s is None else 1.0 / rate_limit_per_s,
            enqueue=self._emitter.enqueue,
            emit_at_once=self._emitter.emit_at_once,
            pull=self._pull,
        )
        policy = FailurePolicy(
            retry,
            on_failure=on_failure,
            timeout_handler=timeout_handler,
            timeout_s=timeout_s,
            metrics=self.metrics,
            attempts=self._attempts,
            settle=self._emitter.settle,
            stop=self._set_failure,
        )
        self._attempts.report_to(policy.outcome, policy.on_error)
        self._emitter.on_timeout = policy.on_timeout

    # Admission ------------------------------------------------------------------------

    def try_add(self, element: Element) -> bool:
        """Admit ``element`` if below capacity (True); never waits. Loop thread only."""
        self._check_usable()
        self._bind()
        if len(self._queue) >= self._capacity:
            return False
        self._admit(element, failures=0, first_attempt_s=None)
        return True

    async def add(self, element: Element) -> None:
        """Admit ``element``, waiting (without blocking the loop) while at capacity."""
        while not self.try_add(element):
            await self._emitter.wait(None)

    async def wait_for_space(self, deadline: float | None = None) -> bool:
        """Wait until a record can be admitted (True) or ``deadline`` passes (False).

        ``deadline`` is wall-clock ``time.time()`` seconds, like every deadline here.
        """
        while len(self._queue) >= self._capacity:
            self._check_usable()
            if deadline is not None and time.time() >= deadline:
                return False
            await self._emitter.wait(deadline)
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
        self._emitter.add_watermark(ts)

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
        self._bind()
        if self._emitter.seq:
            raise EnrichmentError("restore() must come before any add()/add_watermark()")
        for p in pending:
            if p.watermark is not None:
                self.add_watermark(p.watermark)
            else:
                element = Element(p.record, p.coordinates, p.key)
                self._admit(element, failures=p.attempts, first_attempt_s=p.first_attempt_s)

    # Output ---------------------------------------------------------------------------

    def take_ready(self) -> list[Output | DeadLetter | Watermark]:
        """Everything emitted since the last call, in emission order."""
        self._raise_failure()
        return self._emitter.take()

    async def drain(self) -> AsyncIterator[Output | DeadLetter | Watermark]:
        """Yield emitted items as they come until every admitted input was emitted."""
        while True:
            for item in self.take_ready():
                yield item
            if not len(self._queue):
                return
            self._check_usable()
            await self._emitter.wait(None)

    async def finish(self, deadline: float | None = None) -> bool:
        """Wait until every admitted input was emitted (True) or ``deadline`` passed (False).

        ``deadline`` is wall-clock ``time.time()`` seconds. Raises the operator's failure.
        """
        while len(self._queue) or self._source is not None:
            self._check_usable()
            if deadline is not None and time.time() >= deadline:
                return False
            await self._emitter.wait(deadline)
        self._raise_failure()
        return True

    def snapshot(self) -> list[PendingElement]:
        """Stop, and return every input not yet emitted, in original order.

        In-flight and completed-but-not-emitted records, and watermarks still waiting,
        are returned with their retry state; anything that completes later is dropped.
        Collect what was emitted before with :meth:`take_ready`. The operator is closed.
        """
        self._raise_failure()
        self._emitter.emit()
        pending: list[PendingElement] = []
        for entry in self._queue.pending():
            assert isinstance(entry, TrackedEntry)
            pending.append(entry.to_pending())
        self.close()
        return pending

    def close(self) -> None:
        """Cancel timers, retries and running attempts; late results are dropped."""
        if self._attempts.closed:
            return
        self._attempts.close(self._queue.pending())
        self._emitter.notify()

    async def aclose(self, grace_s: float = 0.1) -> None:
        """:meth:`close`, let cancelled attempts unwind, then ``await invoke.aclose()``."""
        tasks = [
            e.task
            for e in self._queue.pending()
            if isinstance(e, TrackedEntry) and e.task is not None and not e.task.done()
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

    # Admission (loop thread) ----------------------------------------------------------

    def _admit(self, element: Element, *, failures: int, first_attempt_s: float | None) -> None:
        key = self._key(element)
        item = self._emitter.enqueue(element, key, time.perf_counter(), failures, first_attempt_s)
        self._attempts.start_first(item)

    def _key(self, element: Element) -> Hashable:
        if self._key_of is None:
            return element.key
        try:
            return self._key_of(element.record)
        except Exception as e:
            raise EnrichmentError(f"key_of raised for {where(element.coordinates)}: {e!r}") from e

    def _pull(self) -> None:
        """Admit inputs from the fed iterator while below capacity (not re-entrant)."""
        if self._pulling or self._source is None:
            return  # when pulling, an admission settled synchronously: the outer loop pulls on
        self._pulling = True
        attempts = self._attempts
        try:
            while self._source is not None and not attempts.closed:
                if len(self._queue) >= self._capacity:
                    return
                eager = attempts.eager and attempts.driving and not attempts.handoff
                if eager:
                    started = time.perf_counter()
                    if started > attempts.slice_end:
                        attempts.paused = True  # the driver yields to the loop, then pulls on
                        return
                try:
                    item = next(self._source)
                except StopIteration:
                    self._source = None
                    self._emitter.notify()
                    return
                if isinstance(item, Watermark):
                    self.add_watermark(item.ts)
                elif eager:
                    attempts.start_eagerly(item, self._key(item), started)
                else:
                    self._admit(item, failures=0, first_attempt_s=None)
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

    def _bind(self) -> None:
        loop = asyncio.get_running_loop()
        if self._emitter.loop is None:
            self._emitter.loop = self._attempts.loop = loop
        elif loop is not self._emitter.loop:
            raise EnrichmentError("an AsyncOperator must be used from one event loop only")

    def _raise_failure(self) -> None:
        if self._failure is not None:
            raise self._failure

    def _check_usable(self) -> None:
        self._raise_failure()
        if self._attempts.closed:
            raise EnrichmentError(
                "the operator was snapshotted or closed: create a new one and restore() "
                "the pending inputs"
            )


def _is_async(fn: Any) -> bool:
    """True for ``async def`` functions, partials of them and objects with ``async __call__``."""
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
        getattr(type(fn), "__call__", None)  # noqa: B004 - async callable objects
    )
