"""The failure policy: what an attempt's outcome, a failure or a timeout leads to.

**The first outcome wins.** An element is settled exactly once — by a result, by its
last failure, or by its timeout — and every report carries its attempt's token; a report
whose token is stale (its element settled, a retry was scheduled after it, or the
operator was snapshotted) is counted in ``metrics.late_ignored`` and dropped. A timeout
cancels any scheduled retry, and a retry re-checks the element before starting, so no
attempt starts after a timeout.

A failed attempt is retried while the retry strategy allows; then the element becomes,
by ``on_failure``, one :class:`DeadLetter`, the results of ``timeout_handler(record)``
(``"fallback"``), or the operator's failure (``"fail"``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, Literal

from microbatch.enrich.attempts import AttemptDriver
from microbatch.enrich.elements import DeadLetter, Output, where
from microbatch.enrich.lifecycle import (
    DONE,
    FAILED,
    RUNNING,
    SETTLED,
    TIMED_OUT,
    WAITING_RETRY,
    ElementState,
    TrackedEntry,
)
from microbatch.enrich.metrics import EnrichMetrics
from microbatch.enrich.results import _InvalidResult, normalize
from microbatch.enrich.retry import RetryStrategy, may_retry_results
from microbatch.errors import EnrichmentError

OnFailure = Literal["fail", "fallback", "dead_letter"]
ON_FAILURE = ("fail", "fallback", "dead_letter")


class FailurePolicy:
    """Settles, retries or gives up on elements as their attempts report (loop thread).

    ``settle(entry, outputs, state)`` hands an element's final outputs to the operator;
    ``stop(error, cause)`` fails the operator; retries start through ``attempts``.
    """

    def __init__(
        self,
        retry: RetryStrategy,
        *,
        on_failure: OnFailure,
        timeout_handler: Callable[[Any], Any] | None,
        timeout_s: float | None,
        metrics: EnrichMetrics,
        attempts: AttemptDriver,
        settle: Callable[[TrackedEntry, list[Any], ElementState], None],
        stop: Callable[[Exception, BaseException | None], None],
    ) -> None:
        self._retry = retry
        self._may_retry_results = may_retry_results(retry)  # else skip asking per result
        self._on_failure = on_failure
        self._timeout_handler = timeout_handler
        self._timeout_s = timeout_s
        self._metrics = metrics
        self._attempts = attempts
        self._settle = settle
        self._stop = stop

    def outcome(
        self, item: TrackedEntry, token: int, value: Any = None, error: BaseException | None = None
    ) -> None:
        """The single entry point of attempt outcomes: stale ones are dropped here."""
        if self._attempts.closed or item.state in SETTLED or token != item.token:
            self._metrics.late_ignored += 1
            return
        item.task = item.call = item.coro = None
        if error is not None:
            retryable = False if isinstance(error, asyncio.CancelledError) else None
            self.on_error(item, error, retryable)
            return
        try:
            results = normalize(value)
            retry_result = self._may_retry_results and self._retry.retries_result(value)
        except Exception as e:
            self.on_error(item, e, False)
            return
        if retry_result:
            item.failures += 1
            if self._try_retry(item):
                return
        self._metrics.completed += 1
        coordinates = item.element.coordinates if item.element else None
        self._settle(item, [Output(v, coordinates) for v in results], DONE)

    def on_error(
        self, item: TrackedEntry, exc: BaseException, retryable: bool | None = None
    ) -> None:
        """A failed attempt: retry it if the strategy says so, else give up on the element."""
        item.failures += 1
        if retryable is None and not isinstance(exc, _InvalidResult):
            try:
                retryable = self._retry.retries_exception(exc)
            except Exception as e:
                exc, retryable = e, False
        if retryable and self._try_retry(item):
            return
        self._metrics.failed += 1
        reason = "invalid_result" if isinstance(exc, _InvalidResult) else "error"
        self._give_up(item, FAILED, reason, exc, item.failures)

    def on_timeout(self, item: TrackedEntry) -> None:
        """The element's timer fired: whatever it is doing, it ends now."""
        item.timer = None
        if item.state in SETTLED or self._attempts.closed:
            return
        self._metrics.timed_out += 1
        attempts = item.failures + (1 if item.state is RUNNING else 0)
        item.cancel_pending_work()  # cancels a scheduled retry: none starts after this
        error = TimeoutError(f"no result within timeout_s={self._timeout_s}")
        self._give_up(item, TIMED_OUT, "timeout", error, attempts)

    def _try_retry(self, item: TrackedEntry) -> bool:
        delay = self._retry.next_delay(item.failures)
        if delay is None:
            return False
        self._metrics.retried += 1
        item.state = WAITING_RETRY
        self._attempts.retry_later(item, delay)
        return True

    def _give_up(
        self,
        item: TrackedEntry,
        state: ElementState,
        reason: str,
        exc: BaseException,
        attempts: int,
    ) -> None:
        """Turn an element out of attempts (or time) into its ``on_failure`` outcome."""
        element = item.element
        assert element is not None
        place = where(element.coordinates, item.seq)
        if self._on_failure == "fail":
            self._stop(
                EnrichmentError(
                    f"enrichment of {place} failed ({reason}) after {attempts} attempt(s): "
                    f"{exc!r}. Fix the service or the function, or choose "
                    "on_failure='dead_letter' to keep going."
                ),
                exc,
            )
            item.state = state  # final, though never emitted: the operator has stopped
            return
        if self._on_failure == "fallback":
            assert self._timeout_handler is not None
            try:
                results = normalize(self._timeout_handler(element.record))
            except Exception as e:
                self._stop(
                    EnrichmentError(f"timeout_handler raised for {place} ({reason}): {e!r}"), e
                )
                item.state = state
                return
            self._metrics.fallbacks += 1
            self._settle(item, [Output(v, element.coordinates) for v in results], state)
            return
        self._metrics.dead_lettered += 1
        letter = DeadLetter(
            element.record,
            reason,
            f"{type(exc).__name__}: {exc}",
            attempts,
            element.coordinates,
            item.first_attempt_s,
        )
        self._settle(item, [letter], state)
