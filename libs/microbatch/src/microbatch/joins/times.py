"""Event times and interval bounds of joins, as epoch milliseconds.

A join reads each side's event time with an :class:`EventTimeOf`: a field name or a
function of the record, whose value may be epoch milliseconds (int or float), an ISO-8601
string (naive means UTC; ``Z`` allowed, as stage 1 reads event times) or a ``datetime``
(naive means UTC). A record without the field is refused with reason
``missing_event_time``, a value that is no time with ``bad_event_time``.

Interval bounds are durations that may be negative: :func:`signed_duration_ms` accepts
what :func:`~microbatch.windows.spec.duration_ms` does, plus a sign (``"-10m"``,
``timedelta(minutes=-10)``, ``-600_000``).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pyarrow as pa

from microbatch.errors import ConfigError
from microbatch.runtime.decoding import MAX_EPOCH_MS, MIN_EPOCH_MS, event_time_ms
from microbatch.windows.spec import Duration, duration_ms

TimeSpec = str | Callable[[Any], Any]


class RecordTimeError(Exception):
    """A record's event time cannot be read: ``reason`` is the dead-letter reason."""

    def __init__(self, reason: str, error: str) -> None:
        super().__init__(error)
        self.reason = reason
        self.error = error


def to_epoch_ms(value: Any) -> int:
    """``value`` as epoch ms: int/float ms, an ISO-8601 string or a datetime (naive: UTC);
    anything else raises ValueError naming it. Read as stage 1 reads the pipeline's event
    time (:func:`microbatch.runtime.decoding.event_time_ms`), so a join and the watermark
    agree to the millisecond."""
    return event_time_ms(value)


class EventTimeOf:
    """Reads one side's event time: ``spec`` is a field name or a function of the record.
    ``op`` and ``arg`` (``"IntervalJoin"``, ``"left_time"``) name it in errors."""

    def __init__(self, op: str, arg: str, spec: TimeSpec | None) -> None:
        if not (isinstance(spec, str) and spec) and not callable(spec):
            raise ConfigError(
                f"{op} needs {arg}: the name of the event-time field or a function "
                f"record -> time; got {spec!r}"
            )
        self.spec = spec
        self._label = f"field {spec!r}" if isinstance(spec, str) else f"{arg} function"

    def __call__(self, record: Any) -> int:
        spec = self.spec
        if isinstance(spec, str):
            raw = record.get(spec) if isinstance(record, dict) else None
        else:
            try:
                raw = spec(record)
            except Exception as e:  # user code: the record's problem, not the batch's
                raise RecordTimeError(
                    "bad_event_time", f"{self._label} raised {type(e).__name__}: {e}"
                ) from e
        if type(raw) is int and MIN_EPOCH_MS <= raw <= MAX_EPOCH_MS:  # most records, no call
            return raw
        if raw is None:
            raise RecordTimeError("missing_event_time", f"record has no event time ({self._label})")
        try:
            return to_epoch_ms(raw)
        except (ValueError, TypeError, OverflowError) as e:
            raise RecordTimeError("bad_event_time", f"{self._label}: {e}") from e

    def plain_column(self, columns: pa.Table) -> np.ndarray | None:
        """:meth:`plain` of records given as ``columns``: where the time is a field held
        as an integer column (else None: read the records). Nulls and values out of range
        are :data:`UNREADABLE`."""
        spec = self.spec
        if not isinstance(spec, str) or spec not in columns.column_names:
            return None
        column = columns.column(spec)
        if pa.types.is_null(column.type):  # no time at all (a side without records)
            return np.full(len(column), UNREADABLE, dtype=np.int64)
        if not pa.types.is_integer(column.type) or pa.types.is_uint64(column.type):
            return None
        values = column.cast(pa.int64()).fill_null(UNREADABLE).to_numpy()
        inside = (values >= MIN_EPOCH_MS) & (values <= MAX_EPOCH_MS)
        return np.where(inside, values, UNREADABLE)

    def plain(self, records: Sequence[Any]) -> np.ndarray:
        """Each record's time where it is plain epoch ms (an int in range, as most are);
        :data:`UNREADABLE` elsewhere — a missing field, a string, a float, a function that
        raises — for :meth:`__call__` to read or refuse one record at a time."""
        spec, low, high = self.spec, MIN_EPOCH_MS, MAX_EPOCH_MS
        if isinstance(spec, str):
            raw = [r.get(spec) if type(r) is dict else None for r in records]
        else:
            raw = [_called(spec, r) for r in records]
        plain = [x if type(x) is int and low <= x <= high else UNREADABLE for x in raw]
        return np.array(plain, dtype=np.int64)


def _called(fn: Callable[[Any], Any], record: Any) -> Any:
    try:
        return fn(record)
    except Exception:  # read again, one record at a time, to dead-letter it
        return None


#: What :meth:`EventTimeOf.plain` gives for a time it leaves to the per-record reading.
UNREADABLE = -(2**63)


def signed_duration_ms(what: str, value: Duration) -> int:
    """A duration that may be negative, in ms: ``"-10m"``, ``"+1h"``, ``"0s"``, a
    ``timedelta`` (any sign) or whole ms (any sign)."""
    try:
        if isinstance(value, str):
            text = value.strip()
            sign = -1 if text.startswith("-") else 1
            body = text[1:] if text[:1] in ("-", "+") else text
            return sign * duration_ms(what, body, allow_zero=True)
        if isinstance(value, dt.timedelta):
            sign = -1 if value < dt.timedelta(0) else 1
            return sign * duration_ms(what, abs(value), allow_zero=True)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    except ConfigError:
        pass
    raise ConfigError(
        f"{what} must be a duration like '-10m', '1h', '250ms', a timedelta or milliseconds, "
        f"in whole milliseconds (negative allowed): {value!r}"
    )
