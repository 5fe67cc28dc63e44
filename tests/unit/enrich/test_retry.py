"""Retry strategies: delays, limits, jitter bounds and predicates."""

from __future__ import annotations

import random

import pytest

from microbatch.enrich import (
    ExponentialBackoff,
    FixedDelay,
    NoRetry,
    retry_on_exception,
    retry_on_result,
)
from microbatch.errors import ConfigError


def test_no_retry_never_gives_a_delay():
    assert NoRetry().next_delay(1) is None
    assert NoRetry().max_attempts == 1


def test_fixed_delay_stops_after_max_attempts():
    strategy = FixedDelay(0.5, max_attempts=3)

    assert [strategy.next_delay(a) for a in (1, 2, 3, 4)] == [0.5, 0.5, None, None]


def test_exponential_backoff_grows_and_caps():
    strategy = ExponentialBackoff(0.1, 0.5, multiplier=2.0, max_attempts=6)

    delays = [strategy.next_delay(a) for a in range(1, 7)]

    assert delays[:5] == pytest.approx([0.1, 0.2, 0.4, 0.5, 0.5])
    assert delays[5] is None


def test_exponential_jitter_stays_within_bounds_and_is_reproducible():
    strategy = ExponentialBackoff(1.0, 8.0, multiplier=2.0, max_attempts=10, jitter=0.5)

    first = [strategy.next_delay(a, random.Random(3)) for a in range(1, 5)]
    again = [strategy.next_delay(a, random.Random(3)) for a in range(1, 5)]

    assert first == again
    for attempt, delay in enumerate(first, start=1):
        full = min(2.0 ** (attempt - 1), 8.0)
        assert full * 0.5 <= delay <= full


def test_injected_rng_on_the_strategy_is_used():
    a = ExponentialBackoff(1.0, 1.0, max_attempts=3, jitter=1.0, rng=random.Random(9))
    b = ExponentialBackoff(1.0, 1.0, max_attempts=3, jitter=1.0, rng=random.Random(9))

    assert a.next_delay(1) == b.next_delay(1)


def test_default_predicates_retry_exceptions_not_results():
    strategy = FixedDelay(0.0, 2)

    assert strategy.retries_exception(ValueError("x"))
    assert not strategy.retries_result(None)


def test_custom_predicates_select_what_is_retried():
    strategy = FixedDelay(
        0.0,
        3,
        predicates=(
            retry_on_exception(lambda e: isinstance(e, ConnectionError)),
            retry_on_result(lambda r: r is None),
        ),
    )

    assert strategy.retries_exception(ConnectionError())
    assert not strategy.retries_exception(ValueError())
    assert strategy.retries_result(None)
    assert not strategy.retries_result({"ok": 1})


@pytest.mark.parametrize(
    "build",
    [
        lambda: FixedDelay(-1.0, 2),
        lambda: FixedDelay(0.1, 0),
        lambda: ExponentialBackoff(0.5, 0.1),
        lambda: ExponentialBackoff(0.1, 1.0, multiplier=0.5),
        lambda: ExponentialBackoff(0.1, 1.0, jitter=1.5),
        lambda: FixedDelay(0.1, 2, predicates=(lambda e: True,)),
    ],
)
def test_invalid_strategy_is_refused_with_the_value(build):
    with pytest.raises(ConfigError):
        build()
