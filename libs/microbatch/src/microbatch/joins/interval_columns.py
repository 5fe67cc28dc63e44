"""An interval join's batch on columns: what ``process`` and the batch's timers do, for
every key at once.

Per side, a key's records are those held in state from earlier batches (with their
``matched`` flags) and the batch's new ones. ``process`` pairs each new record, in
arrival order (time, side, position), with the other side's records held so far: so the
pairs are held × new and new × new (made by the later of the two), never held × held.
Here three range searches over (key, time)-sorted sides find them all at once, and they
are put in the order ``process`` emits them: by the record that makes the pair, then by
its partner's time, held before new, then in list order. The timers the batch's
watermark fires drop every record whose last partner time it passes, emitting the
unmatched ones of an outer side; they are emitted after the key's pairs, by timer, left
before right, and those timers are deleted (they would find nothing left to do). What
stays is written back as ``process`` writes it: a time's list when it got new records,
or for an outer side when a held record found its first partner.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import numpy as np
import pyarrow as pa

from microbatch.joins.base import LEFT, RIGHT, SIDES, each_of_runs, timed_side_tables
from microbatch.joins.held import FLAGGED, Side, lists_of, read_held
from microbatch.joins.select import Fields
from microbatch.joins.times import UNREADABLE
from microbatch.runtime.process import Handled, KeyedBatch

if TYPE_CHECKING:
    from microbatch.joins.interval import IntervalJoin


def join_on_columns(join: IntervalJoin, batch: KeyedBatch) -> Handled | None:
    """Every key of ``batch`` with no record late or of a time that is not plain epoch
    ms, joined on columns; None when the batch has no columns to join on (or key and
    time cannot share one int64)."""
    closes_by, sides = batch.watermark, batch.sides
    if closes_by is None or sides is None or batch.columns is None or not len(sides):
        return None
    if sides.max() > 1:
        return None  # (a record of a third input: process() refuses it)
    select = cast("Fields", join.select)
    found = timed_side_tables(batch, select, join.left_time, join.right_time)
    if found is None:
        return None
    tables, times = found[:2], found[2:]
    key_of = batch.key_of()
    keys_of = (key_of[sides == LEFT], key_of[sides == RIGHT])
    skip = np.zeros(batch.key_count, dtype=bool)
    for side in (LEFT, RIGHT):
        t = times[side]
        unfit = t == UNREADABLE
        if batch.watermark_before is not None:  # late: process() dead-letters it
            unfit |= _expiry(join, side, np.where(unfit, 0, t)) < batch.watermark_before
        skip[keys_of[side][unfit]] = True
    keys = np.flatnonzero(~skip)
    held_left = read_held(batch.map(SIDES[LEFT]), keys, tables[LEFT].schema, FLAGGED)
    held_right = read_held(batch.map(SIDES[RIGHT]), keys, tables[RIGHT].schema, FLAGGED)
    if held_left is None or held_right is None:
        return None
    taken = ~skip
    both = (
        Side.of_records(held_left, taken, tables[LEFT], keys_of[LEFT], times[LEFT]),
        Side.of_records(held_right, taken, tables[RIGHT], keys_of[RIGHT], times[RIGHT]),
    )
    pairs = _pairs(join, *both)
    if pairs is None:
        return None
    li, ri, pair_order = pairs
    final = []
    for side, at in ((LEFT, li), (RIGHT, ri)):
        s = both[side]
        matched = np.concatenate([s.flags, np.zeros(len(s.keys) - s.held, dtype=bool)])
        matched[at] = True
        final.append(matched)
    out_l, out_r, out_order = [li], [ri], [pair_order]
    for side in (LEFT, RIGHT):
        s = both[side]
        if not join.outer[side]:
            continue
        gone = np.flatnonzero((_expiry(join, side, s.times) < closes_by) & ~final[side])
        none = np.full(len(gone), -1, dtype=np.int64)
        out_l.append(gone if side == LEFT else none)
        out_r.append(none if side == LEFT else gone)
        out_order.append(np.stack([
            s.keys[gone], np.ones(len(gone), np.int64), _expiry(join, side, s.times[gone]) + 1,
            np.full(len(gone), side, dtype=np.int64), *_list_place(s, gone),
        ]))  # fmt: skip
    order = np.concatenate(out_order, axis=1)
    emitted = np.lexsort(order[::-1])
    lefts, rights = np.concatenate(out_l)[emitted], np.concatenate(out_r)[emitted]
    columns = [both[LEFT].column(f, lefts) for _, f in select.left]
    columns += [both[RIGHT].column(f, rights) for _, f in select.right]
    for side in (LEFT, RIGHT):
        _write(join, batch, side, both[side], final[side], closes_by)
    return Handled(taken, {}, pa.table(columns, names=select.names), order[0][emitted])


def _expiry(join: IntervalJoin, side: int, times: np.ndarray) -> np.ndarray:
    """:meth:`IntervalJoin.expiry` of records of ``side`` at ``times``."""
    return times + join.upper if side == LEFT else times - join.lower


def _list_place(s: Side, at: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Where records ``at`` of side ``s`` are in their time's list: held ones first (1
    for a new one), by their place in it; then the batch's, by their position."""
    new = s.is_new(at)
    place = np.empty(len(at), dtype=np.int64)
    place[~new] = s.slots[at[~new]]
    place[new] = s.batch_rows[at[new] - s.held]
    return new.astype(np.int64), place


def _pairs(join: IntervalJoin, left: Side, right: Side) -> tuple[np.ndarray, ...] | None:
    """Every pair with a new record: (left index, right index, order columns), the order
    columns (key, 0, maker's arrival, partner's time, partner held or new, its place in
    its list) sorting them as ``process`` emits them."""
    arrival = []
    new = [np.arange(s.held, len(s.keys)) for s in (left, right)]
    ks = np.concatenate([left.keys[new[LEFT]], right.keys[new[RIGHT]]])
    ts = np.concatenate([left.times[new[LEFT]], right.times[new[RIGHT]]])
    ss = np.repeat([LEFT, RIGHT], [len(new[LEFT]), len(new[RIGHT])])
    ps = np.concatenate([left.batch_rows, right.batch_rows])
    rank = np.empty(len(ks), np.int64)
    rank[np.lexsort((ps, ss, ts, ks))] = np.arange(len(ks))
    for side, s in ((LEFT, left), (RIGHT, right)):
        r = np.full(len(s.keys), -1, dtype=np.int64)
        r[new[side]] = rank[: len(new[LEFT])] if side == LEFT else rank[len(new[LEFT]) :]
        arrival.append(r)
    found = []
    held = [np.arange(s.held) for s in (left, right)]
    for lefts, rights in ((new[LEFT], held[RIGHT]), (held[LEFT], new[RIGHT]),
                          (new[LEFT], new[RIGHT])):  # fmt: skip
        got = _in_range(join, left, lefts, right, rights)
        if got is None:
            return None
        found.append(got)
    li = np.concatenate([f[0] for f in found])
    ri = np.concatenate([f[1] for f in found])
    by_left = arrival[LEFT][li] > arrival[RIGHT][ri]  # the later of the two makes the pair
    maker = np.where(by_left, arrival[LEFT][li], arrival[RIGHT][ri])
    right_new, right_place = _list_place(right, ri)
    left_new, left_place = _list_place(left, li)
    partner_new = np.where(by_left, right_new, left_new)
    partner_place = np.where(by_left, right_place, left_place)
    partner_time = np.where(by_left, right.times[ri], left.times[li])
    order = np.stack([left.keys[li], np.zeros(len(li), np.int64), maker, partner_time,
                      partner_new, partner_place])  # fmt: skip
    return li, ri, order


def _in_range(
    join: IntervalJoin, left: Side, lefts: np.ndarray, right: Side, rights: np.ndarray
) -> tuple[np.ndarray, np.ndarray] | None:
    """Every pair of a record of ``lefts`` and one of ``rights`` (indices into each side)
    with the same key and ``tl + lower <= tr <= tl + upper``; None when key and time
    cannot share one int64 (a batch spanning ages)."""
    empty = np.empty(0, np.int64)
    if not len(lefts) or not len(rights):
        return empty, empty
    rights = rights[np.lexsort((rights, right.times[rights], right.keys[rights]))]
    rt, tl = right.times[rights], left.times[lefts]
    low, high = int(rt.min()), int(rt.max())
    span = high - low + 1
    if (max(int(right.keys[rights].max()), int(left.keys[lefts].max())) + 1) * span >= 2**62:
        return None
    spot = right.keys[rights] * span + (rt - low)
    base = left.keys[lefts] * span - low
    lo, hi = tl + join.lower, tl + join.upper
    inside = (lo <= high) & (hi >= low)
    start = np.searchsorted(spot, base + np.clip(lo, low, high), side="left")
    end = np.where(
        inside, np.searchsorted(spot, base + np.clip(hi, low, high), side="right"), start
    )
    run, j = each_of_runs(end - start)
    return lefts[run], rights[start[run] + j]


def _write(
    join: IntervalJoin, batch: KeyedBatch, side: int, s: Side, matched: np.ndarray,
    closes_by: int,
) -> None:  # fmt: skip
    """Side ``side``'s state and timers as ``process`` and the batch's timers leave them:
    each time's list dropped once the watermark passes its last partner time, else
    written when it got a new record (or, on an outer side, a held record its first
    partner), with a timer for each time that got a new record."""
    assert batch.columns is not None
    # Only the times held, or that stay: the batch's records its timers would drop at
    # once leave no trace.
    mine = np.flatnonzero(
        (_expiry(join, side, s.times) >= closes_by) | (np.arange(len(s.keys)) < s.held)
    )
    if not len(mine):
        return
    new, place = _list_place(s, mine)
    sort = np.lexsort((place, new, s.times[mine], s.keys[mine]))
    order, new = mine[sort], new[sort]
    keys, times = s.keys[order], s.times[order]
    starts = np.flatnonzero(np.r_[True, (keys[1:] != keys[:-1]) | (times[1:] != times[:-1])])
    ends = np.r_[starts[1:], len(order)]
    has_new = np.add.reduceat(new, starts) > 0
    flipped = matched & (np.arange(len(s.keys)) < s.held)
    flipped[: s.held] &= ~s.flags
    has_flip = np.add.reduceat(flipped[order].astype(np.int64), starts) > 0
    has_held = np.add.reduceat(1 - new, starts) > 0
    expired = _expiry(join, side, times[starts]) < closes_by
    maps = batch.map(SIDES[side])
    gone = starts[expired & has_held]
    maps.remove_many(keys[gone].tolist(), times[gone].tolist())
    # Their timers would fire for nothing now: every time of these keys that the
    # watermark passes is done here (both sides' lists at one timer included).
    batch.delete_timers(keys[gone].tolist(), (_expiry(join, side, times[gone]) + 1).tolist())
    stays = np.flatnonzero(~expired & (has_new | (has_flip & join.outer[side])))
    if len(stays):
        at = np.concatenate([order[starts[g] : ends[g]] for g in stays])
        lists = lists_of(
            s.payloads(batch.columns.payloads(side), at), ends[stays] - starts[stays], matched[at]
        )
        maps.put_many_encoded(keys[starts[stays]].tolist(), times[starts[stays]].tolist(), lists)
    timed = starts[~expired & has_new]
    batch.register_timers(keys[timed].tolist(), (_expiry(join, side, times[timed]) + 1).tolist())
