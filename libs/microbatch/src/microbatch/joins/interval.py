"""Interval join of two keyed streams: Flink's ``intervalJoin``, Spark's stream-stream join
with a time-range condition.

A left record at ``tl`` and a right record at ``tr`` with the same key form a pair when
``tl + lower <= tr <= tl + upper``. Each side's records wait in keyed state until the
watermark makes a new partner impossible — a left one until the watermark passes
``tl + upper``, a right one until it passes ``tr - lower`` (a record at the watermark is
still on time, so "passes" means ``>``) — then a timer drops them; an outer join emits a
record that never found a partner at that moment, with the other side ``None`` (Spark's
rule for outer stream-stream joins).

**Each pair once.** A call sorts the batch's new records of both sides by (event time,
side, position) and matches each against the other side's records held so far — those of
earlier batches and the batch's records before it in that order — then adds it to its own
side. A pair is therefore made exactly once, by whichever of its two records comes later,
whether they arrive in one batch or in two.

**Late records.** A left record with ``tl + upper`` behind the watermark the batch started
with (a right one with ``tr - lower`` behind it) can pair with no record still to come; it
is a dead letter ``late_join``, never joined nor emitted as unmatched. A record behind the
watermark that can still pair with records to come is joined with them and with what the
other side still holds; partners already dropped are not recovered (Flink drops such a
record altogether). With no record behind the watermark, the pairs do not depend on how
the records were split into batches.

State per key: map states ``left`` and ``right``, event time → ``[[record, matched], ...]``
in arrival order, and one event-time timer per buffered time.

**A batch at once, on columns.** A join with ``select=fields(...)`` and both times read
from fields, whose records reach it as columns (``batch.columns``), takes every key with
no record late or with a time that is not plain epoch ms:
:meth:`IntervalJoin.process_batch` reads the records the key holds back from state into
columns, finds its pairs with numpy, emits the unmatched records of an outer side the
batch's watermark drops, and writes back what stays — the state, timers and output of
``process`` and the batch's timers (:mod:`~microbatch.joins.interval_columns`). The
other keys get ``process``.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator, Sequence
from typing import Any

from microbatch.errors import ConfigError
from microbatch.joins.base import (
    LATE,
    LEFT,
    RIGHT,
    SIDES,
    JoinFunction,
    check_how,
    reads_timed_columns,
)
from microbatch.joins.base import watermark_before as _watermark_before
from microbatch.joins.interval_columns import join_on_columns
from microbatch.joins.select import Select, check_select
from microbatch.joins.times import EventTimeOf, TimeSpec, signed_duration_ms
from microbatch.runtime.process import Handled, KeyedBatch, ProcessContext
from microbatch.state.handles import MapState
from microbatch.windows.spec import Duration

HOWS = ("inner", "left", "right", "full")


class _Buffer:
    """One side's held records of a key, ``{time: [[record, matched], ...]}``: read once
    per call, searched by time range, written back bucket by bucket."""

    def __init__(self, state: MapState) -> None:
        self.state = state
        self.buckets: dict[int, list[list[Any]]] = dict(state.items())
        self.times = sorted(self.buckets)
        self.changed: set[int] = set()

    def between(self, lo: int, hi: int) -> Iterator[tuple[int, list[Any]]]:
        """``(time, entry)`` of each held record with ``lo <= time <= hi``, by time."""
        start = bisect.bisect_left(self.times, lo)
        end = bisect.bisect_right(self.times, hi)
        for t in self.times[start:end]:
            for entry in self.buckets[t]:
                yield t, entry

    def add(self, t: int, entry: list[Any]) -> None:
        if t not in self.buckets:
            bisect.insort(self.times, t)
            self.buckets[t] = []
        self.buckets[t].append(entry)
        self.changed.add(t)

    def write(self) -> None:
        for t in sorted(self.changed):
            self.state.put(t, self.buckets[t])


class IntervalJoin(JoinFunction):
    """Pairs ``(left, right)`` of one key with ``left_time + lower <= right_time <=
    left_time + upper``.

    ``left_time`` / ``right_time``: each side's event-time field or a function of the
    record. ``between=(lower, upper)``: durations, negative allowed (``("-10m", "1h")``,
    ms ints or timedeltas), ``lower <= upper``. ``how``: ``"inner"``; ``"left"``,
    ``"right"`` or ``"full"`` also emit each unmatched record of that side (of both for
    ``"full"``) once the watermark rules out a partner. ``select(left, right)`` makes the
    output record (default :func:`~microbatch.joins.select.merge`).
    """

    def __init__(
        self,
        left_time: TimeSpec,
        right_time: TimeSpec,
        between: Sequence[Duration],
        how: str = "inner",
        select: Select | None = None,
    ) -> None:
        op = self.name
        self.left_time = EventTimeOf(op, "left_time", left_time)
        self.right_time = EventTimeOf(op, "right_time", right_time)
        if isinstance(between, str | bytes) or not (
            isinstance(between, Sequence) and len(between) == 2
        ):
            raise ConfigError(
                f"{op} between must be (lower, upper), e.g. ('-10m', '1h'): {between!r}"
            )
        self.lower = signed_duration_ms(f"{op} between lower bound", between[0])
        self.upper = signed_duration_ms(f"{op} between upper bound", between[1])
        if self.lower > self.upper:
            raise ConfigError(
                f"{op} between: the lower bound {between[0]!r} ({self.lower} ms) is after the "
                f"upper bound {between[1]!r} ({self.upper} ms); no pair could match: give "
                "(lower, upper) with lower <= upper"
            )
        self.how = check_how(op, how, HOWS)
        self.select = check_select(op, select)
        #: Emit unmatched records of the side: (left, right).
        self.outer = (how in ("left", "full"), how in ("right", "full"))

    def __repr__(self) -> str:
        return f"IntervalJoin(between=({self.lower}, {self.upper}) ms, how={self.how!r})"

    def expiry(self, side: int, t: int) -> int:
        """The last watermark at which a record of ``side`` at ``t`` can still get a new
        partner (the newest partner time it accepts)."""
        return t + self.upper if side == LEFT else t - self.lower

    def partners(self, side: int, t: int) -> tuple[int, int]:
        """The range of the other side's times a record of ``side`` at ``t`` pairs with."""
        if side == LEFT:
            return t + self.lower, t + self.upper
        return t - self.upper, t - self.lower

    @property
    def reads_columns(self) -> bool:
        """Can a batch's keys be joined at once on columns (``batch.columns``)? With
        ``fields(...)`` for ``select`` and both times read from a field."""
        return reads_timed_columns(self, self.select, self.left_time, self.right_time)

    def process_batch(self, batch: KeyedBatch) -> Handled | None:
        """Every key with no record late or unreadable, joined at once on columns (see
        :mod:`~microbatch.joins.interval_columns`); None when the batch has no columns
        to join on."""
        if not self.reads_columns:
            return None
        return join_on_columns(self, batch)

    def process(self, key: Any, records: Sequence[Any], ctx: ProcessContext) -> None:
        before = _watermark_before(self.name, ctx)
        arrivals: list[tuple[int, int, int, Any]] = []
        for side, recs in enumerate(self.split(records)):
            time_of = self.left_time if side == LEFT else self.right_time
            for t, position, record in self.timed(ctx, side, recs, time_of):
                if before is not None and self.expiry(side, t) < before:
                    lo, hi = self.partners(side, t)
                    ctx.dead_letter(
                        LATE,
                        f"{self.name}: {SIDES[side]} record at {t} pairs only with "
                        f"{SIDES[1 - side]} records in [{lo}, {hi}], all behind the "
                        f"watermark {before}",
                        record,
                    )
                else:
                    arrivals.append((t, side, position, record))
        if not arrivals:
            return
        arrivals.sort(key=lambda a: a[:3])
        buffers = (_Buffer(ctx.map(SIDES[LEFT])), _Buffer(ctx.map(SIDES[RIGHT])))
        for t, side, _, record in arrivals:
            other = buffers[1 - side]
            mine = [record, False]
            for ot, entry in other.between(*self.partners(side, t)):
                pair = (record, entry[0]) if side == LEFT else (entry[0], record)
                ctx.emit(self.select(*pair))
                mine[1] = True
                if not entry[1]:
                    entry[1] = True
                    if self.outer[1 - side]:  # only outer sides need the flag written
                        other.changed.add(ot)
            buffers[side].add(t, mine)
            ctx.register_timer(self.expiry(side, t) + 1)
        for buffer in buffers:
            buffer.write()

    def on_timer(self, key: Any, timestamp_ms: int, ctx: ProcessContext) -> None:
        """The watermark passed ``timestamp_ms - 1``: drop the records whose last partner
        time that was (and emit them if unmatched, for an outer side)."""
        if ctx.time_domain != "event_time":
            return
        last = timestamp_ms - 1
        for side, t in ((LEFT, last - self.upper), (RIGHT, last + self.lower)):
            state = ctx.map(SIDES[side])
            entries = state.get(t)
            if entries is None:
                continue
            if self.outer[side]:
                for record, matched in entries:
                    if not matched:
                        pair = (record, None) if side == LEFT else (None, record)
                        ctx.emit(self.select(*pair))
            state.remove(t)
