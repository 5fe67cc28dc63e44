"""Window join: pairs of one key whose records fall in the same tumbling or hopping window
(Flink's window join, Nexmark q8).

Each record is assigned to its windows as :mod:`microbatch.windows` assigns them
(half-open ``[start, start + size)``, aligned to the epoch). A window's pairs are emitted
once the watermark reaches its end — no record still to come falls in it then: every
(left, right) pair of the window, left records in arrival order, each with every right
record in arrival order. An inner join: a window with records on one side only emits
nothing.

**Where a window waits.** A window that ends at or after the batch's own watermark
(``ctx.watermark``) waits in keyed state (map states ``left`` and ``right``, window start
→ records in arrival order) with a timer at its end, which emits its pairs and drops it.
A window that ends by the batch's watermark closes in that batch, and its key's records
of the batch all come in one ``process`` call: ``process`` emits its pairs at once (with
the records that waited for it in state, whose timer it deletes) — no state, no timer,
nothing held. Most of a batch's windows are such when a batch spans many of them
(Nexmark q8), and most of those have records on one side only: they cost nothing more.

Output: ``select(left, right)`` (default :func:`~microbatch.joins.select.merge`); when it
is a dict, ``window_start`` and ``window_end`` (epoch ms) are set on a copy of it.

**A batch at once.** Before any ``process`` call, :meth:`WindowJoin.process_batch`
takes the keys whose every window closes in the batch, with no timer (nothing waiting in
state) and no record late or with a time that is not plain epoch ms: numpy places their
records in windows, and only the windows with both sides are read and paired, in the
order ``process`` gives. The other keys get ``process``. On columns (``select=fields(...)``,
both times read from fields, each side's records alike) it takes every key with no
record late for all its windows or of a time that is not plain epoch ms, windows held in
state and windows that stay open included (:mod:`~microbatch.joins.window_columns`).

**Late records.** A record is assigned only to its windows that were still open when its
batch started (``end > watermark``); a record whose every window had closed is a dead
letter ``late_join``. With no record behind the watermark, the pairs do not depend on how
the records were split into batches (their order within a batch may: a window emitted by
``process`` comes in key order, one emitted by its timer in timer order).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from typing import Any

import numpy as np

from microbatch.errors import ConfigError
from microbatch.joins.base import LATE, SIDES, JoinFunction, reads_timed_columns
from microbatch.joins.base import watermark_before as _watermark_before
from microbatch.joins.select import Select, check_select
from microbatch.joins.times import UNREADABLE, EventTimeOf, TimeSpec
from microbatch.joins.window_columns import join_on_columns
from microbatch.runtime.process import Handled, KeyedBatch, ProcessContext
from microbatch.windows.api import WindowBuilder
from microbatch.windows.spec import Duration, Hopping, Tumbling


def window_starts(t: int, spec: Tumbling | Hopping) -> list[int]:
    """Starts of the windows holding time ``t``, ascending (as ``windows.assign``)."""
    if isinstance(spec, Tumbling):
        return [t - t % spec.size_ms]
    latest = t - t % spec.every_ms
    hops = -(-spec.size_ms // spec.every_ms)
    starts = (latest - k * spec.every_ms for k in range(hops))
    return sorted(s for s in starts if s > t - spec.size_ms)


def _spec(op: str, window: Any) -> Tumbling | Hopping:
    if isinstance(window, WindowBuilder):
        window = window.spec
    if isinstance(window, Tumbling | Hopping):
        return window
    if isinstance(window, str | int | dt.timedelta) and not isinstance(window, bool):
        return Tumbling(window)  # a size: tumbling windows
    raise ConfigError(
        f"{op} window must be a tumbling size ('5m'), Tumbling(size) or Hopping(size, every) "
        f"(windows.tumbling / windows.hopping): {window!r}"
    )


class WindowJoin(JoinFunction):
    """Pairs of one key in the same window: ``window`` is a size (tumbling),
    ``Tumbling(size)``, ``Hopping(size, every)`` or ``windows.tumbling(...)`` /
    ``windows.hopping(...)``; ``left_time`` / ``right_time``: each side's event-time field
    or a function of the record."""

    def __init__(
        self,
        left_time: TimeSpec,
        right_time: TimeSpec,
        window: Tumbling | Hopping | WindowBuilder | Duration,
        select: Select | None = None,
    ) -> None:
        op = self.name
        self.left_time = EventTimeOf(op, "left_time", left_time)
        self.right_time = EventTimeOf(op, "right_time", right_time)
        self.window = _spec(op, window)
        self.select = check_select(op, select)

    def __repr__(self) -> str:
        return f"WindowJoin({self.window})"

    def process(self, key: Any, records: Sequence[Any], ctx: ProcessContext) -> None:
        before = _watermark_before(self.name, ctx)
        size = self.window.size_ms
        lefts, rights = self.split(records)
        added = (self._assign(ctx, 0, lefts, before), self._assign(ctx, 1, rights, before))
        closes_by = ctx.watermark
        # A window with records in state has its timer (both are set together and dropped
        # together): only the windows of the key's timers can hold earlier records.
        timers = ctx.timers()
        waiting = {t - size for t in timers} if timers else set()
        states = (ctx.map(SIDES[0]), ctx.map(SIDES[1])) if waiting else None
        for s in sorted(added[0].keys() | added[1].keys()):
            end = s + size
            if closes_by is not None and end <= closes_by:  # closes in this batch: final
                pairs = [added[0].get(s, []), added[1].get(s, [])]
                if states is not None and s in waiting:
                    for side, state in enumerate(states):
                        pairs[side] = state.get(s, []) + pairs[side]
                        state.remove(s)
                    ctx.delete_timer(end)
                self._emit(ctx, pairs[0], pairs[1], s, end)
                continue
            if states is None:
                states = (ctx.map(SIDES[0]), ctx.map(SIDES[1]))
            for side, state in enumerate(states):
                if s in added[side]:
                    earlier = state.get(s, []) if s in waiting else []
                    state.put(s, earlier + added[side][s])
            ctx.register_timer(end)

    def process_batch(self, batch: KeyedBatch) -> Handled | None:
        """The keys whose every window closes in this batch, with nothing waiting for them
        in state and no record late or with a time that is not plain epoch ms: their pairs
        at once. Records are placed in windows with numpy; only the records of windows
        with both sides are read, so a key whose windows have one side costs nothing
        (most of a batch's keys, Nexmark q8). The other keys get ``process``."""
        closes_by, before, sides = batch.watermark, batch.watermark_before, batch.sides
        if closes_by is None or sides is None or not len(batch.records) or sides.max() > 1:
            return None  # (a record of a third input: process() refuses it)
        on_columns = join_on_columns(self, batch)
        if on_columns is not None:
            return on_columns
        records, size = batch.records, self.window.size_ms
        key_of = batch.key_of()
        times = np.empty(len(records), dtype=np.int64)
        for side, time_of in enumerate((self.left_time, self.right_time)):
            at = np.nonzero(sides == side)[0]
            times[at] = time_of.plain([records[i] for i in at.tolist()])
        unreadable = times == UNREADABLE
        rec, start = self._windows_of(np.where(unreadable, 0, times))
        end = start + size
        passed = (end > closes_by) if before is None else (end > closes_by) | (end <= before)
        # a key with a window still open after the batch or closed before it goes per key
        skip = batch.timed.copy()
        skip[key_of[unreadable]] = True
        skip[key_of[rec[passed]]] = True
        keep = ~skip[key_of[rec]]
        rec, start = rec[keep], start[keep]
        key, side = key_of[rec], sides[rec]
        order = np.lexsort((rec, times[rec], side, start, key))
        rec, start, key, side = rec[order], start[order], key[order], side[order]
        emitted, failed = self._pairs(records, rec, start, key, side)
        handled = ~skip
        handled[list(failed)] = False
        return Handled(handled, emitted)

    @property
    def reads_columns(self) -> bool:
        """Can a batch be joined on columns (``batch.columns``)? With ``fields(...)``
        for ``select`` and both times read from a field."""
        return reads_timed_columns(self, self.select, self.left_time, self.right_time)

    def _windows_of(self, times: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(record, window start) of every window of each record, ascending per record
        (as :func:`window_starts`)."""
        spec = self.window
        size = spec.size_ms
        every = spec.every_ms if isinstance(spec, Hopping) else size
        latest = times - times % every
        back = np.arange(-(-size // every) - 1, -1, -1, dtype=np.int64) * every
        starts = latest[:, None] - back[None, :]
        rec, hop = np.nonzero(starts > (times - size)[:, None])
        return rec, starts[rec, hop]

    def _pairs(
        self, records: Sequence[Any], rec: np.ndarray, start: np.ndarray, key: np.ndarray,
        side: np.ndarray,
    ) -> tuple[dict[int, list[Any]], set[int]]:  # fmt: skip
        """The pairs of each (key, window) group with both sides, in ``process``'s order
        (entries sorted by key, window, side, time, position); keys whose ``select``
        raised are left out, for ``process`` to fail or dead-letter as it does."""
        emitted: dict[int, list[Any]] = {}
        failed: set[int] = set()
        if not len(rec):
            return emitted, failed
        new = np.ones(len(rec), dtype=bool)
        new[1:] = (key[1:] != key[:-1]) | (start[1:] != start[:-1])
        first = np.nonzero(new)[0]
        last = np.append(first[1:], len(rec))
        lefts = np.add.reduceat((side == 0).astype(np.int64), first)
        both = np.nonzero((lefts > 0) & (lefts < last - first))[0]
        select, size, positions = self.select, self.window.size_ms, rec.tolist()
        for a, m, b, k, s in zip(
            first[both].tolist(), (first[both] + lefts[both]).tolist(), last[both].tolist(),
            key[first[both]].tolist(), start[first[both]].tolist(), strict=True,
        ):  # fmt: skip
            if k in failed:
                continue
            rows, rights = emitted.setdefault(k, []), [records[i] for i in positions[m:b]]
            try:
                for i in positions[a:m]:
                    left = records[i]
                    for right in rights:
                        out = select(left, right)
                        if isinstance(out, dict):
                            out = {**out, "window_start": s, "window_end": s + size}
                        rows.append(out)
            except Exception:  # process() calls it again and fails or dead-letters
                failed.add(k)
                del emitted[k]
        return emitted, failed

    def _assign(
        self, ctx: ProcessContext, side: int, records: list[Any], before: int | None
    ) -> dict[int, list[Any]]:
        """Window start → the side's records of this call in it, in time order; a record
        whose every window had closed by ``before`` is a dead letter."""
        if not records:
            return {}
        time_of: EventTimeOf = self.left_time if side == 0 else self.right_time
        spec = self.window
        size = spec.size_ms
        added: dict[int, list[Any]] = {}
        for t, _, record in self.timed(ctx, side, records, time_of):
            starts = window_starts(t, spec)
            if before is not None and starts[0] + size <= before:  # its first window closed
                open_ = [s for s in starts if s + size > before]
                if not open_:
                    ctx.dead_letter(
                        LATE,
                        f"{self.name}: {SIDES[side]} record at {t} falls only in windows "
                        f"that had closed (ends <= the watermark {before}): "
                        f"{', '.join(f'[{s}, {s + size})' for s in starts)}",
                        record,
                    )
                starts = open_
            for s in starts:
                window = added.get(s)
                if window is None:
                    added[s] = [record]
                else:
                    window.append(record)
        return added

    def _emit(
        self, ctx: ProcessContext, lefts: list[Any], rights: list[Any], start: int, end: int
    ) -> None:
        """Every (left, right) pair of the window ``[start, end)``, left records in order,
        each with every right record in order."""
        select, emit = self.select, ctx.emit
        for lrec in lefts:
            for rrec in rights:
                out = select(lrec, rrec)
                if isinstance(out, dict):
                    out = {**out, "window_start": start, "window_end": end}
                emit(out)

    def on_timer(self, key: Any, timestamp_ms: int, ctx: ProcessContext) -> None:
        """The window ending at ``timestamp_ms`` closed: emit its pairs, forget it."""
        if ctx.time_domain != "event_time":
            return
        start = timestamp_ms - self.window.size_ms
        left, right = ctx.map(SIDES[0]), ctx.map(SIDES[1])
        self._emit(ctx, left.get(start, []), right.get(start, []), start, timestamp_ms)
        left.remove(start)
        right.remove(start)
