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

**A batch at once, on columns.** An inner join with ``select=fields(...)`` and both times
read from fields, whose records reach it as columns (``batch.columns``), first takes the
keys that would leave nothing behind: nothing held from earlier batches, no record late
or with a time that is not plain epoch ms, and every record's last partner time passed
by the batch's own watermark (``process`` would pair them and their timers would drop
them all in this batch). :meth:`IntervalJoin.process_batch` finds their pairs with numpy
(a range search per record over the other side, sorted by key and time) and takes them
from both sides' columns, in the order ``process`` emits them. The other keys get
``process``.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator, Sequence
from typing import Any, cast

import numpy as np
import pyarrow as pa

from microbatch.errors import ConfigError
from microbatch.joins.base import (
    LATE,
    LEFT,
    RIGHT,
    SIDES,
    JoinFunction,
    check_how,
    each_of_runs,
    rows_in_side,
    side_tables,
)
from microbatch.joins.base import watermark_before as _watermark_before
from microbatch.joins.select import Fields, Select, check_select
from microbatch.joins.times import UNREADABLE, EventTimeOf, TimeSpec, signed_duration_ms
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
        """Can a batch's keys be joined at once on columns (``batch.columns``)? An inner
        join with ``fields(...)`` for ``select`` and both times read from a field."""
        return (
            self.how == "inner"
            and isinstance(self.select, Fields)
            and all(isinstance(t.spec, str) for t in (self.left_time, self.right_time))
        )

    def process_batch(self, batch: KeyedBatch) -> Handled | None:
        """The keys that leave nothing behind, joined at once on columns (see the module
        doc); None when the batch has no columns to join on."""
        closes_by, sides = batch.watermark, batch.sides
        if closes_by is None or sides is None or batch.columns is None or not self.reads_columns:
            return None
        if not len(batch.records) or sides.max() > 1:
            return None  # (a record of a third input: process() refuses it)
        select = cast("Fields", self.select)
        spec = cast("tuple[str, str]", (self.left_time.spec, self.right_time.spec))
        tables = side_tables(batch, select, spec)
        if tables is None:
            return None
        left, right = tables
        lt, rt = self.left_time.plain_column(left), self.right_time.plain_column(right)
        if lt is None or rt is None:
            return None
        times = np.empty(len(sides), np.int64)
        times[sides == LEFT], times[sides == RIGHT] = lt, rt
        row_of, key_of = rows_in_side(sides), batch.key_of()
        unreadable = times == UNREADABLE
        readable = np.where(unreadable, 0, times)
        expiry = np.where(sides == LEFT, readable + self.upper, readable - self.lower)
        leaves = unreadable | (expiry >= closes_by)  # a timer of it would wait past the batch
        before = batch.watermark_before
        if before is not None:
            leaves |= expiry < before  # late: process() dead-letters it
        skip = batch.timed.copy()
        skip[key_of[leaves]] = True
        pairs = self._pairs_at_once(np.flatnonzero(~skip[key_of]), times, key_of, sides)
        if pairs is None:
            return None
        lefts, rights = pairs
        out = {name: left.column(f).take(pa.array(row_of[lefts])) for name, f in select.left}
        out |= {name: right.column(f).take(pa.array(row_of[rights])) for name, f in select.right}
        return Handled(~skip, {}, pa.table(out), key_of[lefts])

    def _pairs_at_once(
        self, taken: np.ndarray, times: np.ndarray, key_of: np.ndarray, sides: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray] | None:
        """Every pair (left position, right position) among the records at ``taken``, in
        the order ``process`` emits them: by the later record of the pair in arrival
        order (key, time, side, position), then by the earlier one. None when key and
        time cannot share one int64 (a batch spanning ages)."""
        if not len(taken):
            return np.empty(0, np.int64), np.empty(0, np.int64)
        low, high = int(times[taken].min()), int(times[taken].max())
        span = high - low + 1
        if (int(key_of[taken].max()) + 1) * span >= 2**62:
            return None
        arrival = np.empty(len(times), np.int64)
        order = taken[np.lexsort((taken, sides[taken], times[taken], key_of[taken]))]
        arrival[order] = np.arange(len(order))
        lefts = taken[sides[taken] == LEFT]
        rights = taken[sides[taken] == RIGHT]
        rights = rights[np.lexsort((arrival[rights],))]  # by key, time, position
        spot = key_of[rights] * span + (times[rights] - low)
        tl, base = times[lefts], key_of[lefts] * span - low
        lo = np.clip(tl + self.lower, low, high)
        hi = np.clip(tl + self.upper, low, high)
        found = (tl + self.lower <= high) & (tl + self.upper >= low)
        start = np.searchsorted(spot, base + lo, side="left")
        end = np.where(found, np.searchsorted(spot, base + hi, side="right"), start)
        count = end - start
        run, j = each_of_runs(count)
        paired_left = lefts[run]
        paired_right = rights[start[run] + j]
        a, b = arrival[paired_left], arrival[paired_right]
        emitted = np.lexsort((np.minimum(a, b), np.maximum(a, b)))
        return paired_left[emitted], paired_right[emitted]

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
