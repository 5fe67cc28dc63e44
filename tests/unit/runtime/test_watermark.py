"""Watermarks across partitions: min of active partitions (or Spark's global max),
idleness, never backwards."""

from __future__ import annotations

import pytest

from microbatch.errors import ConfigError
from microbatch.runtime import EventTime
from microbatch.runtime.watermark import WatermarkState, advance

ET = EventTime(field="ts", allowed_lateness_s=1, idle_timeout_s=10)


def test_watermark_is_the_slowest_active_partition_minus_lateness() -> None:
    s = advance(WatermarkState(), {"t/0": 5000, "t/1": 9000}, 100_000, ET)
    assert s.watermark == 4000


def test_an_idle_partition_stops_holding_the_watermark_back() -> None:
    s = advance(WatermarkState(), {"t/0": 5000, "t/1": 9000}, 100_000, ET)
    s = advance(s, {"t/1": 20_000}, 105_000, ET)
    assert s.watermark == 4000  # t/0 quiet for 5 s: still active
    s = advance(s, {"t/1": 30_000}, 111_000, ET)
    assert s.watermark == 29_000  # t/0 idle for 11 s > 10 s


def test_when_every_partition_is_idle_the_watermark_catches_up_to_the_max() -> None:
    s = advance(WatermarkState(), {"t/0": 5000, "t/1": 9000}, 0, ET)
    s = advance(s, {}, 60_000, ET)
    assert s.watermark == 8000


def test_the_watermark_never_goes_back_and_round_trips_through_json() -> None:
    s = advance(WatermarkState(), {"t/0": 9000}, 0, ET)
    s = advance(s, {"t/1": 100}, 1, ET)  # a new, slower partition appears
    assert s.watermark == 8000
    assert WatermarkState.from_json(s.to_json()) == s


GLOBAL = EventTime(field="ts", allowed_lateness_s=1, idle_timeout_s=10, watermark="global_max")


def test_global_max_is_the_fastest_partition_minus_lateness_as_in_spark() -> None:
    s = advance(WatermarkState(), {"t/0": 5000, "t/1": 9000}, 100_000, GLOBAL)
    assert s.watermark == 8000  # min_partition: 4000
    s = advance(s, {"t/0": 7000}, 100_001, GLOBAL)  # t/0 catching up moves nothing
    assert s.watermark == 8000
    s = advance(s, {"t/0": 12_000}, 100_002, GLOBAL)
    assert s.watermark == 11_000


def test_global_max_ignores_idleness_and_new_slow_partitions_and_never_goes_back() -> None:
    s = advance(WatermarkState(), {"t/0": 9000}, 0, GLOBAL)
    s = advance(s, {"t/1": 100}, 60_000, GLOBAL)  # t/0 idle, t/1 new and far behind
    assert s.watermark == 8000
    assert WatermarkState.from_json(s.to_json()) == s


def test_an_unknown_watermark_rule_is_refused_with_its_value() -> None:
    with pytest.raises(ConfigError, match="'max'"):
        EventTime(field="ts", watermark="max")  # type: ignore[arg-type]
