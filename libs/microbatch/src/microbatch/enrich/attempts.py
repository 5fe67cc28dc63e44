"""Attempts: each call of the enrichment function, started and seen through to one report.

An attempt starts with a fresh token on its entry (see ``TrackedEntry.begin_attempt``)
and ends with one report to the failure policy — its value or its error — which drops it
if the token went stale meanwhile. Coroutines run in driver tasks of their own, blocking
functions in a thread pool, anything else awaitable as a future. Rate-limited attempts
(first calls and retries) start at evenly spaced slots.

Attempts start **eagerly** inside a driver task (see ``_drive``): a new element's
coroutine runs at once up to its first suspension, in the task that then awaits the
rest of it. A result that is there without suspending (an in-process lookup, a cache
hit) and that its queue would emit at once skips the queue altogether — no entry, no
task, no timer — which makes the operator's cost per such element a few Python calls. A
run of eager attempts yields to the loop after ``_EAGER_SLICE_S``, so timers and
deadlines still fire even when the function never waits.
"""

from __future__ import annotations

import asyncio
import inspect
import time
import types
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine, Hashable, Iterable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from types import CoroutineType
from typing import Any

from microbatch.enrich.elements import Element
from microbatch.enrich.lifecycle import SETTLED, TrackedEntry
from microbatch.enrich.queues import Entry
from microbatch.enrich.results import _InvalidResult

_STALE = asyncio.CancelledError("stale attempt")  # marker: cancelled by the operator
_EAGER_SLICE_S = 0.01  # longest run of eager admissions between two loop steps

#: ``(entry, token, value=None, error=None)``: an attempt's outcome, maybe stale.
Report = Callable[..., None]


class AttemptDriver:
    """Starts the attempts of queued elements and reports each outcome (loop thread only).

    What it needs from the operator comes in as callables: ``enqueue`` (queue an element
    and start its timeout), ``emit_at_once`` (emit a result without queueing it, if the
    order allows) and ``pull`` (admit more fed inputs). Outcomes go to ``report`` and
    failures to start an attempt to ``failed`` (see :meth:`report_to`). The operator's
    pull loop reads ``closed``, ``eager``, ``driving``, ``handoff``, ``slice_end`` and
    sets ``paused``.
    """

    def __init__(
        self,
        invoke: Callable[[Any], Awaitable[Any]] | Callable[[Any], Any],
        *,
        blocking: bool,
        max_workers: int,
        interval: float | None,
        enqueue: Callable[[Element, Hashable, float], TrackedEntry],
        emit_at_once: Callable[[Element, Hashable, Any, float], bool],
        pull: Callable[[], None],
    ) -> None:
        self._invoke = invoke
        self._blocking = blocking
        self._max_workers = max_workers
        self._interval = interval  # seconds between attempt starts, None: no rate limit
        self._next_slot = 0.0
        self._executor: ThreadPoolExecutor | None = None
        self._enqueue = enqueue
        self._emit_at_once = emit_at_once
        self._pull = pull
        self._report: Report = _not_connected
        self._failed: Callable[[TrackedEntry, BaseException], None] = _not_connected
        self.loop: asyncio.AbstractEventLoop | None = None  # set when the operator binds
        self.closed = False  # set once by close(): nothing starts or counts any more
        # A new element's first attempt: at once, or at the next rate-limit slot.
        self.start_first = self.start if interval is None else self.schedule
        self.eager = not blocking and interval is None
        self.driving = False  # a driver task is handling an outcome right now
        self.handoff: deque[tuple[TrackedEntry, int, Coroutine[Any, Any, Any]]] = deque()
        self.slice_end = 0.0  # perf_counter time at which an eager pull pauses
        self.paused = False  # an eager pull stopped to let the loop run; its driver resumes

    def report_to(
        self, report: Report, failed: Callable[[TrackedEntry, BaseException], None]
    ) -> None:
        """Send outcomes to ``report`` and failures to start an attempt to ``failed``."""
        self._report = report
        self._failed = failed

    def start_eagerly(self, element: Element, key: Hashable, started: float) -> None:
        """Admit a new element by running its attempt up to its first suspension, here.

        Only from a driver task with nothing handed off: if the attempt suspends, that
        driver goes on with it next, so the function runs in one task from start to end
        (``asyncio.current_task()``, and the timeouts built on it, stay right). A result
        there without suspending that the queue would emit at once skips the queue.
        """
        try:
            attempt = self._invoke(element.record)
        except Exception as e:  # raised before returning an awaitable: the attempt failed
            item = self._enqueue(element, key, started)
            item.begin_attempt()
            self._failed(item, e)
            return
        if type(attempt) is not CoroutineType:  # a future, or another coroutine type
            item = self._enqueue(element, key, started)
            self._follow(item, item.begin_attempt(), attempt)
            return
        try:
            waiting_on = attempt.send(None)
        except StopIteration as stop:
            if not self._emit_at_once(element, key, stop.value, started):
                item = self._enqueue(element, key, started)
                self._report(item, item.begin_attempt(), value=stop.value)
            return
        except (Exception, asyncio.CancelledError) as e:
            item = self._enqueue(element, key, started)
            self._report(item, item.begin_attempt(), error=e)
            return
        item = self._enqueue(element, key, started)
        token = item.begin_attempt()
        item.coro = attempt
        self.handoff.append((item, token, _resumed(attempt, waiting_on)))

    def schedule(self, item: TrackedEntry) -> None:
        """Start an attempt now, or at the next rate-limit slot."""
        item.retry_handle = None
        if self._interval is not None:
            assert self.loop is not None
            now = self.loop.time()
            slot = max(now, self._next_slot)
            self._next_slot = slot + self._interval
            if slot > now:
                item.retry_handle = self.loop.call_at(slot, self.start, item)
                return
        self.start(item)

    def retry_later(self, item: TrackedEntry, delay: float) -> None:
        """Schedule the next attempt in ``delay`` seconds; stale the finished one."""
        assert self.loop is not None
        item.token += 1  # whatever the finished attempt still reports is stale now
        item.retry_handle = self.loop.call_later(delay, self.schedule, item)

    def start(self, item: TrackedEntry) -> None:
        """Start an attempt now, unless the element was settled or the operator closed."""
        item.retry_handle = None
        if item.state in SETTLED or self.closed:  # timed out or snapshotted while waiting
            return
        assert self.loop is not None and item.element is not None
        token = item.begin_attempt()
        record = item.element.record
        try:
            if not self._blocking:
                self._follow(item, token, self._invoke(record))
                return
            item.call = self._pool().submit(self._invoke, record)
            future = asyncio.wrap_future(item.call, loop=self.loop)
        except Exception as e:  # raised before any await: the attempt failed
            self._failed(item, e)
            return
        item.task = future
        future.add_done_callback(partial(self._on_attempt_done, item, token))

    def close(self, entries: Iterable[Entry]) -> None:
        """Stop for good: cancel the entries' timers, retries and running attempts."""
        self.closed = True
        for entry in entries:
            if isinstance(entry, TrackedEntry):
                entry.cancel_pending_work()
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)

    def _follow(self, item: TrackedEntry, token: int, attempt: Any) -> None:
        """See the attempt ``invoke`` returned through to its outcome."""
        assert self.loop is not None
        if type(attempt) is CoroutineType or inspect.iscoroutine(attempt):
            # The common case: drive the coroutine in our own task, so its outcome is
            # handled in the same loop step (no extra done-callback round).
            item.coro = attempt
            if self.driving:  # a driver task will run it right after this step
                self.handoff.append((item, token, attempt))
            else:
                item.task = self.loop.create_task(self._drive(item, token, attempt))
            return
        try:
            if not inspect.isawaitable(attempt):
                raise _InvalidResult(
                    f"invoke returned {type(attempt).__name__}, not an awaitable: define "
                    "it with `async def`, or pass blocking=True for a plain function"
                )
            future = asyncio.ensure_future(attempt)
        except Exception as e:
            self._failed(item, e)
            return
        item.task = future
        future.add_done_callback(partial(self._on_attempt_done, item, token))

    async def _drive(self, item: TrackedEntry, token: int, coro: Coroutine[Any, Any, Any]) -> None:
        """Run attempts in this task: this one, then any it started (see ``handoff``).

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
                if not (self.closed or item.state in SETTLED or token != item.token):
                    cancelled = asyncio.CancelledError("the attempt was cancelled")
                    self._report(item, token, error=cancelled)
                    raise  # cancelled by someone else: end this task as cancelled
                task.uncancel()  # cancelled by us (timeout, snapshot): nothing to report
                if self.closed:
                    return
                error = _STALE
            except Exception as e:
                error = e
            if error is not _STALE:
                self.driving = True
                self.slice_end = time.perf_counter() + _EAGER_SLICE_S
                try:
                    self._report(item, token, value=value, error=error)
                finally:
                    self.driving = False
            while self.paused and not self.handoff:
                # An eager pull ran for a whole slice without giving the loop a chance:
                # let timers and deadlines fire, then pull on from this task.
                self.paused = False
                await asyncio.sleep(0)
                self.driving = True
                self.slice_end = time.perf_counter() + _EAGER_SLICE_S
                try:
                    self._pull()
                finally:
                    self.driving = False
            if not self.handoff:
                return
            item, token, coro = self.handoff.popleft()
            item.task = task
            while self.handoff:
                other, other_token, other_coro = self.handoff.popleft()
                other.task = asyncio.ensure_future(self._drive(other, other_token, other_coro))

    def _on_attempt_done(self, item: TrackedEntry, token: int, future: asyncio.Future[Any]) -> None:
        """Done-callback of future-style attempts (thread-pool calls, client futures)."""
        if future.cancelled():
            if not (self.closed or item.state in SETTLED or token != item.token):
                self._report(item, token, error=asyncio.CancelledError("cancelled"))
            return
        error = future.exception()  # also marks it retrieved
        if error is not None:
            self._report(item, token, error=error)
        else:
            self._report(item, token, value=future.result())

    def _pool(self) -> ThreadPoolExecutor:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(
                max_workers=self._max_workers, thread_name_prefix="microbatch-enrich"
            )
        return self._executor


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


def _not_connected(*args: Any, **kwargs: Any) -> None:
    raise RuntimeError("AttemptDriver.report_to() was not called")
