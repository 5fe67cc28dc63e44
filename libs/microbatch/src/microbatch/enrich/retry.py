"""Retry strategies for the async operator: when to try again, and after how long.

Pure values: no clock, no I/O. The operator asks a strategy two questions after an
attempt ends — *should this outcome be retried?* (the predicates) and *how long to wait
before the next attempt, if any?* (:meth:`next_delay`). Attempts are counted from 1 and
include the first call, so ``max_attempts=3`` means one call and up to two retries.

The element's timeout (``AsyncOperator(timeout_s=...)``) bounds all attempts together; a
strategy never extends it.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from microbatch.errors import ConfigError


@dataclass(frozen=True)
class RetryPredicate:
    """Says whether one kind of attempt outcome (an exception or a result) is retried."""

    on: Literal["exception", "result"]
    test: Callable[[Any], bool]


def retry_on_exception(test: Callable[[BaseException], bool]) -> RetryPredicate:
    """Retry attempts that raised an exception for which ``test(exc)`` is true."""
    return RetryPredicate("exception", test)


def retry_on_result(test: Callable[[Any], bool]) -> RetryPredicate:
    """Retry attempts whose raw return value makes ``test(value)`` true (e.g. ``None``).

    When the attempts run out, the last result is emitted as a normal result.
    """
    return RetryPredicate("result", test)


def _any_exception(_: BaseException) -> bool:
    return True


#: Default predicates: every exception is retried, no result is.
DEFAULT_PREDICATES: tuple[RetryPredicate, ...] = (retry_on_exception(_any_exception),)


class _Predicates:
    """Shared predicate evaluation for the strategies below."""

    predicates: tuple[RetryPredicate, ...]
    max_attempts: int

    def retries_exception(self, exc: BaseException) -> bool:
        """True if a strategy predicate asks to retry after ``exc``."""
        return any(p.on == "exception" and p.test(exc) for p in self.predicates)

    def retries_result(self, value: Any) -> bool:
        """True if a strategy predicate asks to retry after the result ``value``."""
        return any(p.on == "result" and p.test(value) for p in self.predicates)

    def _check_common(self) -> None:
        if not isinstance(self.max_attempts, int) or self.max_attempts < 1:
            raise ConfigError(f"max_attempts must be an int >= 1, got {self.max_attempts!r}")
        for p in self.predicates:
            if not isinstance(p, RetryPredicate):
                raise ConfigError(
                    f"retry predicates must come from retry_on_exception/retry_on_result, got {p!r}"
                )


@dataclass(frozen=True)
class NoRetry(_Predicates):
    """Every element gets exactly one attempt."""

    predicates: tuple[RetryPredicate, ...] = ()
    max_attempts: int = field(default=1, init=False)

    def next_delay(self, attempt: int, rng: random.Random | None = None) -> float | None:
        """Never another attempt."""
        return None


@dataclass(frozen=True)
class FixedDelay(_Predicates):
    """Up to ``max_attempts`` attempts, ``delay_s`` seconds apart."""

    delay_s: float
    max_attempts: int
    predicates: tuple[RetryPredicate, ...] = DEFAULT_PREDICATES

    def __post_init__(self) -> None:
        if self.delay_s < 0:
            raise ConfigError(f"FixedDelay.delay_s must be >= 0 seconds, got {self.delay_s!r}")
        self._check_common()

    def next_delay(self, attempt: int, rng: random.Random | None = None) -> float | None:
        """Delay before attempt ``attempt + 1``, or None once ``attempt`` reached the limit."""
        return None if attempt >= self.max_attempts else self.delay_s


@dataclass(frozen=True)
class ExponentialBackoff(_Predicates):
    """Delays ``initial_s * multiplier**(n-1)`` capped at ``max_delay_s``, minus jitter.

    ``jitter`` in ``[0, 1]`` is the fraction of each delay that is random: the delay is
    drawn uniformly from ``[d * (1 - jitter), d]``, so it never exceeds ``max_delay_s``
    and many elements failing together do not retry in lock-step. ``rng`` makes the
    jitter reproducible (tests); without it the module's shared generator is used.
    """

    initial_s: float
    max_delay_s: float
    multiplier: float = 2.0
    max_attempts: int = 5
    jitter: float = 0.0
    rng: random.Random | None = field(default=None, compare=False, repr=False)
    predicates: tuple[RetryPredicate, ...] = DEFAULT_PREDICATES

    def __post_init__(self) -> None:
        if self.initial_s < 0 or self.max_delay_s < self.initial_s:
            raise ConfigError(
                "ExponentialBackoff needs 0 <= initial_s <= max_delay_s, got "
                f"initial_s={self.initial_s!r}, max_delay_s={self.max_delay_s!r}"
            )
        if self.multiplier < 1:
            raise ConfigError(
                f"ExponentialBackoff.multiplier must be >= 1, got {self.multiplier!r}"
            )
        if not 0.0 <= self.jitter <= 1.0:
            raise ConfigError(f"ExponentialBackoff.jitter must be in [0, 1], got {self.jitter!r}")
        self._check_common()

    def next_delay(self, attempt: int, rng: random.Random | None = None) -> float | None:
        """Delay before attempt ``attempt + 1``, or None once ``attempt`` reached the limit."""
        if attempt >= self.max_attempts:
            return None
        delay = min(self.initial_s * self.multiplier ** max(attempt - 1, 0), self.max_delay_s)
        if self.jitter:
            source = rng or self.rng or random
            delay -= delay * self.jitter * source.random()
        return delay


RetryStrategy = NoRetry | FixedDelay | ExponentialBackoff


def may_retry_results(strategy: Any) -> bool:
    """False if ``strategy`` retries no result whatever it is (one of the strategies here
    without a ``retry_on_result`` predicate), so nobody needs to ask it per result."""
    if isinstance(strategy, _Predicates) and (
        type(strategy).retries_result is _Predicates.retries_result
    ):
        return any(p.on == "result" for p in strategy.predicates)
    return True
