"""An element's life inside the async operator: its named states and the entry carrying them.

::

    QUEUED ──▶ RUNNING ──result──▶ DONE
                │  ▲
      failure,  │  │ the retry
    retry left  ▼  │ starts
            WAITING_RETRY

    RUNNING ── last failure ──▶ FAILED
    QUEUED, RUNNING or WAITING_RETRY ── timeout ──▶ TIMED_OUT

A result the retry strategy rejects counts as a failure, yet is emitted when no retry
is left (``DONE``). ``DONE``, ``FAILED`` and ``TIMED_OUT`` are final: the element was
settled, exactly once (with ``on_failure="fail"`` the last two stop the operator
instead). A watermark's entry is ``DONE`` from the start. Only the loop thread reads or
writes an entry.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Coroutine, Hashable
from concurrent.futures import Future
from enum import IntEnum
from typing import Any

from microbatch.enrich.elements import Element, PendingElement
from microbatch.enrich.queues import Entry


class ElementState(IntEnum):
    """Where an element is: waiting, running an attempt, or settled.

    An ``IntEnum`` hashes like an int, which keeps ``state in SETTLED`` cheap.
    """

    QUEUED = 0  # admitted; its first attempt has not started (e.g. waits for a rate slot)
    RUNNING = 1  # an attempt is in flight, or its outcome is being decided
    WAITING_RETRY = 2  # an attempt failed and the next one is scheduled
    DONE = 3  # settled by a result
    FAILED = 4  # settled by its last failure: a dead letter or the fallback's results
    TIMED_OUT = 5  # settled by its timeout: a dead letter or the fallback's results


# Module-level names for the hot path: ``ElementState.X`` goes through the enum's
# metaclass and costs ~60 ns a lookup (CPython 3.11), a global costs a few.
QUEUED = ElementState.QUEUED
RUNNING = ElementState.RUNNING
WAITING_RETRY = ElementState.WAITING_RETRY
DONE = ElementState.DONE
FAILED = ElementState.FAILED
TIMED_OUT = ElementState.TIMED_OUT
SETTLED = frozenset({DONE, FAILED, TIMED_OUT})


class TrackedEntry(Entry):
    """A queue entry with one element's state and pending work (or one watermark)."""

    __slots__ = (
        "admitted_at",
        "base",
        "call",
        "coro",
        "element",
        "failures",
        "first_attempt_s",
        "outputs",
        "retry_handle",
        "started",
        "state",
        "task",
        "timer",
        "token",
        "ts",
    )

    def __init__(self, seq: int, *, key: Hashable = None, is_watermark: bool = False) -> None:
        super().__init__(seq, key=key, is_watermark=is_watermark)
        self.state = DONE if is_watermark else QUEUED
        self.element: Element | None = None
        self.ts: int | float | None = None  # a watermark's timestamp
        self.failures = 0  # attempts that ended in a failure, across batches
        self.base = 0  # failures before the latest attempt started
        self.first_attempt_s: float | None = None
        self.admitted_at = 0.0  # loop clock, for timers
        self.started = 0.0  # perf_counter, for latency (uvloop's clock has ms steps)
        self.token = 0  # the current attempt's; a report carrying another one is stale
        self.task: asyncio.Future[Any] | None = None
        self.call: Future[Any] | None = None  # the thread-pool call of a blocking attempt
        self.coro: Coroutine[Any, Any, Any] | None = None  # the attempt driven by ``task``
        self.timer: asyncio.TimerHandle | None = None
        self.retry_handle: asyncio.Handle | None = None
        self.outputs: list[Any] = []

    def begin_attempt(self) -> int:
        """Mark an attempt as started; its token."""
        self.token += 1
        self.base = self.failures
        self.state = RUNNING
        if self.first_attempt_s is None:
            self.first_attempt_s = time.time()
        return self.token

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

    def to_pending(self) -> PendingElement:
        """What a snapshot keeps of this not yet emitted entry."""
        if self.is_watermark:
            return PendingElement(watermark=self.ts)
        e = self.element
        assert e is not None
        # Settled by an attempt but not emitted: that attempt is redone on restore, so
        # it must not count (else a last failed attempt would be one too many).
        redo = self.state is DONE or self.state is FAILED
        attempts = self.base if redo else self.failures
        return PendingElement(e.record, e.coordinates, e.key, attempts, self.first_attempt_s)
