"""Window specs: tumbling, hopping and session windows over event time, in milliseconds.

- **Tumbling** ``size``: fixed, non-overlapping ``[k·size, (k+1)·size)``; each record is in
  exactly one window.
- **Hopping** ``size`` every ``every``: windows of ``size`` starting at every multiple of
  ``every``, so a record is in ``ceil(size / every)`` or ``floor(size / every)`` windows
  (Spark's sliding ``window(ts, size, slide)``, Flink's sliding windows).
- **Session** ``gap``: per key, a record opens ``[ts, ts + gap)`` and overlapping windows
  merge, so a session ends ``gap`` after its last record (Spark's ``session_window``,
  Flink's event-time session windows).

Windows are half-open and aligned to the epoch (Unix time 0), the alignment Spark and
Flink use by default. A spec that cannot work — a hop longer than the window, a gap or
size that is not positive — is a :class:`~microbatch.errors.ConfigError` when the pipeline
is built, never a surprise in a batch.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import re

from microbatch.errors import ConfigError

_UNITS_MS = {"ms": 1, "s": 1000, "m": 60_000, "h": 3_600_000, "d": 86_400_000}
_DURATION = re.compile(r"^\s*(\d+)\s*(ms|s|m|h|d)\s*$")

Duration = str | int | dt.timedelta


def duration_ms(what: str, value: Duration, *, allow_zero: bool = False) -> int:
    """``"5m"``, ``"30s"``, ``"250ms"``, ``"1h"``, ``"1d"``, a ``timedelta`` or whole ms, as
    a positive number of milliseconds (or zero, with ``allow_zero``)."""
    if isinstance(value, dt.timedelta):
        ms = value / dt.timedelta(milliseconds=1)
        if ms != int(ms):
            raise ConfigError(f"{what} must be whole milliseconds: {value!r}")
        ms = int(ms)
    elif isinstance(value, int) and not isinstance(value, bool):
        ms = value
    elif isinstance(value, str) and (m := _DURATION.match(value)):
        ms = int(m.group(1)) * _UNITS_MS[m.group(2)]
    else:
        raise ConfigError(
            f"{what} must be a duration like '5m', '30s', '250ms', '1h', '1d', a timedelta "
            f"or milliseconds: {value!r}"
        )
    if ms < 0 or (ms == 0 and not allow_zero):
        raise ConfigError(f"{what} must be positive: {value!r}")
    return ms


@dataclasses.dataclass(frozen=True)
class Tumbling:
    size_ms: int

    def __init__(self, size: Duration) -> None:
        object.__setattr__(self, "size_ms", duration_ms("tumbling window size", size))

    @property
    def max_span_ms(self) -> int:
        """How long after its first record a window can still get records (its size)."""
        return self.size_ms


@dataclasses.dataclass(frozen=True)
class Hopping:
    size_ms: int
    every_ms: int

    def __init__(self, size: Duration, every: Duration) -> None:
        size_ms = duration_ms("hopping window size", size)
        every_ms = duration_ms("hopping window every", every)
        if every_ms > size_ms:
            raise ConfigError(
                f"a hopping window every {every!r} is longer than its size {size!r}: records "
                "between windows would belong to none; use every <= size (equal is tumbling)"
            )
        object.__setattr__(self, "size_ms", size_ms)
        object.__setattr__(self, "every_ms", every_ms)

    @property
    def max_span_ms(self) -> int:
        return self.size_ms


@dataclasses.dataclass(frozen=True)
class Session:
    gap_ms: int

    def __init__(self, gap: Duration) -> None:
        object.__setattr__(self, "gap_ms", duration_ms("session gap", gap))

    @property
    def max_span_ms(self) -> None:
        """Unbounded: a session lasts as long as records keep coming within the gap."""
        return None


WindowSpec = Tumbling | Hopping | Session
