"""Window specs refuse what cannot work; assignment on columns matches the definitions
record by record."""

from __future__ import annotations

import datetime as dt
import random

import numpy as np
import pytest

from microbatch.errors import ConfigError
from microbatch.windows import Hopping, Session, Tumbling, duration_ms
from microbatch.windows.assign import hopping, sessions, tumbling


@pytest.mark.parametrize(
    ("text", "ms"),
    [("250ms", 250), ("30s", 30_000), ("5m", 300_000), ("1h", 3_600_000), ("1d", 86_400_000)],
)
def test_durations_read_as_milliseconds(text: str, ms: int) -> None:
    assert duration_ms("size", text) == ms


def test_a_timedelta_or_plain_milliseconds_is_a_duration_too() -> None:
    assert duration_ms("size", dt.timedelta(minutes=2)) == 120_000
    assert duration_ms("size", 1500) == 1500


@pytest.mark.parametrize("bad", ["5 minutes", "", "-5m", "0s", 0, -3, 2.5, True, None])
def test_a_duration_that_cannot_work_is_a_config_error(bad) -> None:
    with pytest.raises(ConfigError, match="size"):
        duration_ms("size", bad)


def test_a_hop_longer_than_its_window_is_refused_with_what_to_do() -> None:
    with pytest.raises(
        ConfigError, match=r"every '10m' is longer than its size '5m'.*every <= size"
    ):
        Hopping("5m", every="10m")
    with pytest.raises(ConfigError, match="session gap must be positive"):
        Session(gap="0s")


def test_tumbling_windows_hold_each_record_once_also_before_1970() -> None:
    ts = np.array([0, 1, 299_999, 300_000, -1, -300_000, -300_001])
    rows, starts = tumbling(ts, Tumbling("5m"))

    assert rows.tolist() == list(range(7))
    assert starts.tolist() == [0, 0, 0, 300_000, -300_000, -300_000, -600_000]


def test_hopping_windows_are_every_aligned_window_that_holds_the_record() -> None:
    rng = random.Random(1)
    spec = Hopping("10m", every="3m")  # not a multiple: 3 or 4 windows per record
    ts = np.array([rng.randrange(-(10**9), 10**9) for _ in range(2000)])

    rows, starts = hopping(ts, spec)

    for i, t in enumerate(ts.tolist()):
        expected = [
            s
            for s in range((t // spec.every_ms - 5) * spec.every_ms, t + 1, spec.every_ms)
            if s <= t < s + spec.size_ms
        ]
        assert sorted(starts[rows == i].tolist()) == expected


def test_sessions_close_a_gap_after_their_last_record_per_key() -> None:
    keys = np.array([b"a", b"b", b"a", b"a", b"b", b"a"], dtype=object)
    ts = np.array([0, 5, 20, 40, 50, 100])

    ids, starts, ends = sessions(keys, ts, gap_ms=30)

    # a: 0, 20, 40 chain (each < previous + 30) then 100 opens a new one; b: 5 and 50 apart
    assert starts.tolist() == [0, 100, 5, 50]
    assert ends.tolist() == [70, 130, 35, 80]
    assert ids.tolist() == [0, 2, 0, 0, 3, 1]


def test_records_exactly_a_gap_apart_share_a_session_as_in_spark() -> None:
    """Spark 4.2's session_window: events at 0 s, 30 s, 59 s and 100 s with a 30 s gap
    give the sessions [0 s, 89 s) of 3 and [100 s, 130 s) of 1 (checked on pyspark)."""
    ids, starts, ends = sessions(np.array([1, 1, 1, 1]), np.array([0, 30, 59, 100]), gap_ms=30)
    assert ids.tolist() == [0, 0, 0, 1]
    assert starts.tolist() == [0, 100] and ends.tolist() == [89, 130]
