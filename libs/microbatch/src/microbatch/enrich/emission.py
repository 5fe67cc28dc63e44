"""Emission: admitted inputs numbered and queued in their mode's order, then handed out.

Every admitted input takes the next sequence number and a queue entry (which starts its
timeout) — or, when its result is there at once and its queue holds nothing it must
wait for, goes straight out without one. Settled entries leave as their queue allows;
what left waits in ``ready`` until the operator's caller takes it. Waiters (a producer
at capacity, ``finish``) wake whenever something leaves or the operator stops.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Hashable
from typing import Any

from microbatch.enrich.elements import DeadLetter, Element, Output, Watermark
from microbatch.enrich.lifecycle import ElementState, TrackedEntry
from microbatch.enrich.metrics import EnrichMetrics
from microbatch.enrich.queues import KeyOrderedQueue, OrderedQueue, UnorderedQueue
from microbatch.enrich.results import SCALARS, _InvalidResult, normalize

Queue = OrderedQueue | UnorderedQueue | KeyOrderedQueue


class Emitter:
    """The operator's queue side (loop thread only).

    ``pull`` is called after each emission (room may have freed up for fed inputs);
    ``on_timeout(entry)`` when an entry's ``timeout_s`` runs out (set by the operator
    once its failure policy exists); ``loop`` is set when the operator binds.
    """

    def __init__(
        self,
        queue: Queue,
        *,
        metrics: EnrichMetrics,
        timeout_s: float | None,
        may_retry_results: bool,
        pull: Callable[[], None],
    ) -> None:
        self.queue = queue
        self.seq = 0  # the next input's position in the input order
        self.ready: list[Output | DeadLetter | Watermark] = []
        self.waiters: list[asyncio.Future[None]] = []
        self.loop: asyncio.AbstractEventLoop | None = None
        self.on_timeout: Callable[[TrackedEntry], None] = _no_timeout_handler
        self._metrics = metrics
        self._timeout_s = timeout_s
        self._may_retry_results = may_retry_results  # then no result is emitted at once
        self._pull = pull

    def enqueue(
        self,
        element: Element,
        key: Hashable,
        started: float,
        failures: int = 0,
        first_attempt_s: float | None = None,
    ) -> TrackedEntry:
        """Queue ``element`` in input order and start its timeout; no attempt yet."""
        seq = self.seq
        self.seq = seq + 1
        item = TrackedEntry(seq, key=key)
        item.element = element
        item.failures = failures
        item.first_attempt_s = first_attempt_s
        item.started = started
        self.queue.add(item)
        self._metrics.in_flight = len(self.queue)
        if self._timeout_s is not None:
            loop = self.loop
            assert loop is not None
            item.admitted_at = loop.time()
            item.timer = loop.call_at(item.admitted_at + self._timeout_s, self.on_timeout, item)
        return item

    def add_watermark(self, ts: int | float) -> None:
        """Queue a watermark after everything admitted so far; emit what may leave."""
        item = TrackedEntry(self.seq, is_watermark=True)
        self.seq += 1
        item.ts = ts
        self.queue.add(item)
        self.emit()

    def emit_at_once(self, element: Element, key: Hashable, value: Any, started: float) -> bool:
        """Emit a result that needs no queueing (False: queue it as usual)."""
        if self._may_retry_results or not self.queue.emits_at_once(key):
            return False
        if type(value) in SCALARS:  # one result: what normalize says, minus a list
            self.ready.append(Output(value, element.coordinates))
        else:
            try:
                results = normalize(value)
            except _InvalidResult:
                return False
            coordinates = element.coordinates
            self.ready.extend([Output(v, coordinates) for v in results])
        self.seq += 1  # its place in the input order, as if queued
        self._metrics.completed += 1
        self._metrics.observe_latency(time.perf_counter() - started)
        if self.waiters:
            self.notify()
        return True

    def settle(self, item: TrackedEntry, outputs: list[Any], state: ElementState) -> None:
        """The element's one and only outcome: hand it to the queue and emit."""
        if item.timer or item.retry_handle or item.task or item.call:
            item.cancel_pending_work()
        else:  # nothing to cancel (the common case): only stale any late report
            item.token += 1
            item.coro = None
        item.state = state
        item.outputs = outputs
        self._metrics.observe_latency(time.perf_counter() - item.started)
        self.queue.complete(item)
        self.emit()

    def emit(self) -> None:
        """Move what the queue lets out to ``ready``; wake waiters; pull more input."""
        ready = self.queue.pop_ready()
        if not ready:
            return
        out = self.ready
        for entry in ready:
            assert isinstance(entry, TrackedEntry)
            if entry.is_watermark:
                assert entry.ts is not None
                out.append(Watermark(entry.ts))
            else:
                out.extend(entry.outputs)
                entry.outputs = []
        self._metrics.in_flight = len(self.queue)
        self.notify()
        self._pull()

    def take(self) -> list[Output | DeadLetter | Watermark]:
        """Everything emitted since the last call, in emission order."""
        out, self.ready = self.ready, []
        return out

    async def wait(self, deadline: float | None) -> None:
        """Wait until something is emitted, the operator stops, or ``deadline`` passes."""
        assert self.loop is not None
        waiter = self.loop.create_future()
        self.waiters.append(waiter)
        timer = None
        if deadline is not None:
            timer = self.loop.call_later(max(0.0, deadline - time.time()), _wake, waiter)
        try:
            await waiter
        finally:
            if timer is not None:
                timer.cancel()

    def notify(self) -> None:
        """Wake every waiter."""
        if not self.waiters:
            return
        waiters, self.waiters = self.waiters, []
        for waiter in waiters:
            _wake(waiter)


def _no_timeout_handler(item: TrackedEntry) -> None:
    raise RuntimeError("Emitter.on_timeout was not set")


def _wake(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)
