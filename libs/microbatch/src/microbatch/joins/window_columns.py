"""A window join's batch on columns: what ``process`` and the batch's timers do, for every
key at once.

A key's records are placed in their windows (the open ones: a record's window that had
closed when the batch started is skipped, as ``process`` skips it); with the records each
window holds in state from earlier batches, each side's entries are put in the order
``process`` keeps them: held ones first, then the batch's by time and position. A window
the batch's watermark closes emits every (left, right) pair, left records in order, each
with every right record; a window with records of the batch is emitted in ``process``
(by window start), one that only held records by its timer, after them — so those come
second. A window that stays open gets its new records written after the held ones, with
a timer at its end; a closed one is dropped, with its timer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple, cast

import numpy as np
import pyarrow as pa

from microbatch.joins.base import LEFT, RIGHT, SIDES, each_of_runs, timed_side_tables
from microbatch.joins.held import LIST, Side, lists_of, read_held
from microbatch.joins.select import Fields
from microbatch.joins.times import UNREADABLE
from microbatch.runtime.process import Handled, KeyedBatch

if TYPE_CHECKING:
    from microbatch.joins.window import WindowJoin


def join_on_columns(join: WindowJoin, batch: KeyedBatch) -> Handled | None:
    """Every key of ``batch`` with no record late for all its windows or of a time that
    is not plain epoch ms, joined on columns; None when the batch has no columns."""
    closes_by, before, sides = batch.watermark, batch.watermark_before, batch.sides
    if closes_by is None or sides is None or not len(sides) or sides.max() > 1:
        return None
    if batch.columns is None or not join.reads_columns:
        return None
    found = timed_side_tables(batch, cast("Fields", join.select), join.left_time, join.right_time)
    if found is None:
        return None
    tables, times = found[:2], found[2:]
    size = join.window.size_ms
    key_of = batch.key_of()
    keys_of = (key_of[sides == LEFT], key_of[sides == RIGHT])
    skip = np.zeros(batch.key_count, dtype=bool)
    placed = []
    for side in (LEFT, RIGHT):
        t = times[side]
        unreadable = t == UNREADABLE
        rec, start = join._windows_of(np.where(unreadable, 0, t))
        if before is not None:  # a window closed when the batch started takes no record
            rec, start = rec[start + size > before], start[start + size > before]
        placed_somewhere = np.zeros(len(t), dtype=bool)
        placed_somewhere[rec] = True
        skip[keys_of[side][unreadable | ~placed_somewhere]] = True  # process dead-letters
        placed.append((rec, start))
    keys = np.flatnonzero(~skip)
    held = [read_held(batch.map(SIDES[s]), keys, tables[s].schema, LIST) for s in (LEFT, RIGHT)]
    if held[LEFT] is None or held[RIGHT] is None:
        return None
    taken = ~skip
    entries = []
    for side in (LEFT, RIGHT):
        rec, start = placed[side]
        mine = taken[keys_of[side][rec]]
        rec, start = rec[mine], start[mine]
        s = Side.of(cast("Side", held[side]), taken, tables[side], rec, keys_of[side][rec], start)
        entries.append(_Entries(s, _in_window_order(s, times[side])))
    windows = _Windows(entries, size, closes_by)
    out, (lefts, rights) = _pairs(entries, windows)
    select = cast("Fields", join.select)
    columns = {name: entries[LEFT].side.column(f, lefts) for name, f in select.left}
    columns |= {name: entries[RIGHT].side.column(f, rights) for name, f in select.right}
    columns["window_start"] = pa.array(windows.starts[out])
    columns["window_end"] = pa.array(windows.starts[out] + size)
    _write(batch, entries, windows, size)
    return Handled(taken, {}, pa.table(columns), windows.keys[out])


class _Entries(NamedTuple):
    """One side's entries in windows (a :class:`Side` whose times are window starts; a
    record of the batch once per window it is in) and ``order``, the entries in their
    windows' order."""

    side: Side
    order: np.ndarray


def _in_window_order(s: Side, times: np.ndarray) -> np.ndarray:
    """The entries of ``s`` by key and window, then as ``process`` keeps them in it:
    held ones in their list's order, then the batch's by time (``times``: each row's of
    the side's table) and position."""
    first = np.concatenate([s.slots, times[s.batch_rows]])
    then = np.concatenate([np.zeros(s.held, np.int64), s.batch_rows])
    new = s.is_new(np.arange(len(s.keys))).astype(np.int64)
    return np.lexsort((then, first, new, s.times, s.keys))


class _Windows:
    """Every (key, window start) with an entry, by key and start, and where each side's
    entries of it are in that side's order: ``at[side][w]`` to ``end[side][w]``."""

    def __init__(self, entries: list[_Entries], size: int, closes_by: int) -> None:
        both = [(e.side.keys[e.order], e.side.times[e.order]) for e in entries]
        keys = np.concatenate([k for k, _ in both])
        starts = np.concatenate([t for _, t in both])
        ranks = np.unique(starts)
        ids = keys * max(len(ranks), 1) + np.searchsorted(ranks, starts)
        unique, first = np.unique(ids, return_index=True)
        self.keys, self.starts = keys[first], starts[first]
        self.at: list[np.ndarray] = []
        self.end: list[np.ndarray] = []
        self.new: list[np.ndarray] = []  # per window, how many of the side's are the batch's
        for (k, t), e in zip(both, entries, strict=True):
            side_ids = k * max(len(ranks), 1) + np.searchsorted(ranks, t)
            self.at.append(np.searchsorted(side_ids, unique, side="left"))
            self.end.append(np.searchsorted(side_ids, unique, side="right"))
            is_new = e.side.is_new(e.order).astype(np.int64)
            cum = np.r_[0, np.cumsum(is_new)]
            self.new.append(cum[self.end[-1]] - cum[self.at[-1]])
        self.count = [e - a for a, e in zip(self.at, self.end, strict=True)]
        self.closes = self.starts + size <= closes_by
        self.any_new = (self.new[LEFT] + self.new[RIGHT]) > 0
        held = [c - n for c, n in zip(self.count, self.new, strict=True)]
        self.any_held = (held[LEFT] + held[RIGHT]) > 0


def _pairs(
    entries: list[_Entries], w: _Windows
) -> tuple[np.ndarray, tuple[np.ndarray, np.ndarray]]:
    """The output rows' windows and their (left, right) entries, in the order ``process``
    and the timers emit them: per key, windows with records of the batch first (by
    start), then those that only held records; in a window, left by left, each with
    every right."""
    counts = np.where(w.closes, w.count[LEFT] * w.count[RIGHT], 0)
    window, j = each_of_runs(counts)
    across = w.count[RIGHT][window]
    lefts = entries[LEFT].order[w.at[LEFT][window] + j // np.maximum(across, 1)]
    rights = entries[RIGHT].order[w.at[RIGHT][window] + j % np.maximum(across, 1)]
    later = (~w.any_new[window]).astype(np.int64)  # emitted by a timer, after process
    order = np.lexsort((j, w.starts[window], later, w.keys[window]))
    return window[order], (lefts[order], rights[order])


def _write(batch: KeyedBatch, entries: list[_Entries], w: _Windows, size: int) -> None:
    """The state and timers ``process`` and the timers leave: a closed window with held
    records dropped, its timer too; an open one with records of the batch gets them
    after its held ones, per side, and a timer at its end."""
    assert batch.columns is not None
    gone = np.flatnonzero(w.closes & w.any_held)
    for side in (LEFT, RIGHT):
        batch.map(SIDES[side]).remove_many(w.keys[gone].tolist(), w.starts[gone].tolist())
    batch.delete_timers(w.keys[gone].tolist(), (w.starts[gone] + size).tolist())
    stays = ~w.closes & w.any_new
    for side, e in enumerate(entries):
        grown = np.flatnonzero(stays & (w.new[side] > 0))
        if not len(grown):
            continue
        at = np.concatenate([e.order[w.at[side][g] : w.end[side][g]] for g in grown])
        payloads = e.side.payloads(batch.columns.payloads(side), at)
        lists = lists_of(payloads, w.count[side][grown])
        batch.map(SIDES[side]).put_many_encoded(
            w.keys[grown].tolist(), w.starts[grown].tolist(), lists
        )
    opened = np.flatnonzero(stays)
    batch.register_timers(w.keys[opened].tolist(), (w.starts[opened] + size).tolist())
