"""Temporal (as-of) join: each left record joined with the right side's version valid at
its event time (Flink's event-time temporal join, Quix's ``join_asof``).

The right side (side 1) is a versioned table: each right record is the key's version
from its event time on, until the next version. A left record at ``t`` joins the version
with the greatest version time ``<= t``; two versions with the same time: the later one
(later batch, then later in source order) replaces the earlier.

**Deterministic with out-of-order data.** A left record is held (map state ``pending``)
until the watermark passes ``t`` — by then every version at or before ``t`` that is on
time has arrived — and is emitted by the timer at ``t + 1``, in the batch whose watermark
passes ``t``. So the output does not depend on how records were split into batches, as
long as no record came behind the watermark.

**Retention.** Versions (map state ``versions``) are kept for ``retention`` behind the
watermark: once the watermark passes ``v + retention`` for a version ``v``, every version
older than the newest one at or before ``watermark - retention`` is dropped; that one (and
so the latest version at or before the watermark) is always kept. A key's last version is
never dropped: it is the value for every later record.

**Late records** (dead letters ``late_join``): a left record more than ``retention``
behind the watermark the batch started with (its version may be gone); a right version
older than a version already in force at that horizon (no record still to come can join
it). A left record behind the watermark but within the retention is joined like any
other, in the same batch.

``how="inner"``: a left record with no version at or before its time emits nothing;
``"left"``: it is emitted with the right side ``None``.

**A batch at once, on columns.** With ``select=fields(...)`` and both times read from
fields, where each side's records are alike (see :mod:`~microbatch.runtime.side_columns`),
:meth:`TemporalJoin.process_batch` takes every key of the batch with no record late or
unreadable. Its versions and waiting left records are read back from state into
columns; the left records the batch's watermark passes — waiting ones and new — find
their version by a numpy search over all keys at once, and the output is taken from
both sides' columns. The batch's versions are stored as the payloads they came as,
with their retention timers, and the left records still waiting as lists of theirs,
with their timers: the state, timers and output of each key are those ``process`` and
the batch's timers leave. Other keys go to ``process``.

**No deletes.** A version lasts until the next one: a right ``None`` record has no
version time, so Kafka tombstones (``KafkaSource(tombstones=True)``) cannot feed this
join — refused when the pipeline is built, unlike a :class:`~microbatch.joins.TableJoin`.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import Any, cast

import numpy as np
import pyarrow as pa

from microbatch.errors import ConfigError
from microbatch.joins.base import (
    LATE,
    LEFT,
    RIGHT,
    JoinFunction,
    check_how,
    reads_timed_columns,
    timed_side_tables,
)
from microbatch.joins.base import watermark_before as _watermark_before
from microbatch.joins.held import LIST, ONE, Side, lists_of, read_held
from microbatch.joins.select import Fields, Select, check_select
from microbatch.joins.times import UNREADABLE, EventTimeOf, TimeSpec
from microbatch.runtime.process import Handled, KeyedBatch, ProcessContext
from microbatch.windows.spec import Duration, duration_ms

HOWS = ("inner", "left")
VERSIONS, PENDING = "versions", "pending"


class TemporalJoin(JoinFunction):
    """Left records joined with the right version valid at their event time.

    ``left_time`` / ``right_time``: each side's event-time field or a function of the
    record (a right record's time is its version's start). ``retention``: how long
    versions are kept behind the watermark (``"1h"``, ms, timedelta; > 0) — also how far
    behind the watermark a left record may come and still be joined. ``how``:
    ``"inner"`` or ``"left"``. ``select(left, right)`` makes the output record (default
    :func:`~microbatch.joins.select.merge`).
    """

    def __init__(
        self,
        left_time: TimeSpec,
        right_time: TimeSpec,
        retention: Duration | None,
        select: Select | None = None,
        how: str = "inner",
    ) -> None:
        op = self.name
        self.left_time = EventTimeOf(op, "left_time", left_time)
        self.right_time = EventTimeOf(op, "right_time", right_time)
        if retention is None:
            raise ConfigError(
                f"{op} needs a retention (how long right versions are kept behind the "
                "watermark, e.g. '1h'); without one its state would grow without bound"
            )
        self.retention = duration_ms(f"{op} retention", retention)
        self.how = check_how(op, how, HOWS)
        self.select = check_select(op, select)

    def __repr__(self) -> str:
        return f"TemporalJoin(retention={self.retention} ms, how={self.how!r})"

    @property
    def reads_columns(self) -> bool:
        """Can a batch's keys be joined at once on columns (``batch.columns``)? With
        ``fields(...)`` for ``select`` and both times read from a field."""
        return reads_timed_columns(self, self.select, self.left_time, self.right_time)

    def process_batch(self, batch: KeyedBatch) -> Handled | None:
        """The keys with nothing late or unreadable, joined at once on columns (see the
        module doc); None when the batch has no columns to join on."""
        watermark, sides = batch.watermark, batch.sides
        if watermark is None or sides is None or batch.columns is None or not self.reads_columns:
            return None
        if not len(batch.records) or sides.max() > 1:
            return None  # (a record of a third input: process() refuses it)
        select = cast("Fields", self.select)
        found = timed_side_tables(batch, select, self.left_time, self.right_time)
        if found is None:
            return None
        left, right, lt, rt = found
        key_of = batch.key_of()
        left_keys, right_keys = key_of[sides == LEFT], key_of[sides == RIGHT]
        before = batch.watermark_before
        horizon = UNREADABLE if before is None else before - self.retention
        skip = np.zeros(batch.key_count, dtype=bool)
        skip[left_keys[(lt == UNREADABLE) | (lt < horizon)]] = True  # process dead-letters
        skip[right_keys[rt == UNREADABLE]] = True
        keys = np.flatnonzero(~skip)
        waiting = read_held(batch.map(PENDING), keys, left.schema, LIST)
        stored = read_held(batch.map(VERSIONS), keys, right.schema, ONE)
        if waiting is None or stored is None:
            return None
        in_force = np.full(batch.key_count, UNREADABLE, dtype=np.int64)
        at_horizon = stored.times <= horizon
        np.maximum.at(in_force, stored.keys[at_horizon], stored.times[at_horizon])
        skip[right_keys[rt < in_force[right_keys]]] = True  # late: process dead-letters it
        taken = ~skip
        versions = Side.of_records(stored, taken, right, right_keys, rt)
        lefts = Side.of_records(waiting, taken, left, left_keys, lt)
        # Left records by key, time, then as they wait (earlier batches' first): the
        # order the timers emit them in. Those the watermark passes go out now.
        order = np.lexsort((np.arange(len(lefts.keys)), lefts.times, lefts.keys))
        due = order[lefts.times[order] < watermark]
        version = _newest_at(_latest(versions), lefts.keys[due], lefts.times[due])
        if self.how == "inner":
            due, version = due[version >= 0], version[version >= 0]
        columns = [lefts.column(f, due) for _, f in select.left]
        columns += [versions.column(f, version) for _, f in select.right]
        self._write(batch, versions, lefts, order, watermark)
        return Handled(taken, {}, pa.table(columns, names=select.names), lefts.keys[due])

    def _write(
        self, batch: KeyedBatch, versions: Side, lefts: Side, order: np.ndarray, watermark: int
    ) -> None:
        """The state and timers ``process`` and the batch's timers leave: the batch's
        versions (the last of each time) with their retention timers; each time's left
        records still waiting, with their timer; no entry for a time that was emitted."""
        assert batch.columns is not None
        latest = _latest(versions)[2]
        new = latest[latest >= versions.held] - versions.held  # the batch's, once each
        added_keys, added_times = versions.keys[versions.held :], versions.times[versions.held :]
        batch.map(VERSIONS).put_many_encoded(
            added_keys[new].tolist(), added_times[new].tolist(),
            batch.columns.payloads(RIGHT).take(versions.batch_rows[new]).to_pylist(),
        )  # fmt: skip
        expiries = added_times[new] + self.retention
        batch.register_timers(added_keys[new].tolist(), expiries.tolist())
        if not len(order):
            return
        pending = batch.map(PENDING)
        keys, times = lefts.keys[order], lefts.times[order]
        starts = np.flatnonzero(np.r_[True, (keys[1:] != keys[:-1]) | (times[1:] != times[:-1])])
        ends = np.r_[starts[1:], len(order)]
        grew = np.add.reduceat((order >= lefts.held).astype(np.int64), starts)  # new ones
        gone = (times[starts] < watermark) & (grew < ends - starts)  # emitted: had waited
        pending.remove_many(keys[starts[gone]].tolist(), times[starts[gone]].tolist())
        stays = np.flatnonzero((times[starts] >= watermark) & (grew > 0))  # with new records
        if not len(stays):
            return
        at = np.concatenate([order[starts[s] : ends[s]] for s in stays])
        lists = lists_of(
            lefts.payloads(batch.columns.payloads(LEFT), at), ends[stays] - starts[stays]
        )
        pending.put_many_encoded(keys[starts[stays]].tolist(), times[starts[stays]].tolist(), lists)
        batch.register_timers(keys[starts[stays]].tolist(), (times[starts[stays]] + 1).tolist())

    def process(self, key: Any, records: Sequence[Any], ctx: ProcessContext) -> None:
        before = _watermark_before(self.name, ctx)
        horizon = None if before is None else before - self.retention
        lefts, rights = self.split(records)
        if rights:
            versions = ctx.map(VERSIONS)
            timed = self.timed(ctx, RIGHT, rights, self.right_time)
            in_force = None  # the newest held version at or before the horizon
            if horizon is not None and timed:
                in_force = max((v for v, _ in versions.items() if v <= horizon), default=None)
            for t, _, record in timed:  # by time, then source order: the last one wins
                if in_force is not None and t < in_force:
                    ctx.dead_letter(
                        LATE,
                        f"{self.name}: right version at {t} is older than the version at "
                        f"{in_force}, in force at the watermark {before} minus the retention "
                        f"({self.retention} ms): no record still to come can join it",
                        record,
                    )
                    continue
                versions.put(t, record)
                ctx.register_timer(t + self.retention)
        if lefts:
            pending = ctx.map(PENDING)
            waiting: dict[int, list[Any]] = {}
            for t, _, record in self.timed(ctx, LEFT, lefts, self.left_time):
                if horizon is not None and t < horizon:
                    ctx.dead_letter(
                        LATE,
                        f"{self.name}: left record at {t} is behind the watermark {before} "
                        f"by more than the retention ({self.retention} ms): the version "
                        "valid then may be gone",
                        record,
                    )
                    continue
                waiting.setdefault(t, []).append(record)
            for t, new in waiting.items():
                pending.put(t, pending.get(t, []) + new)
                ctx.register_timer(t + 1)

    def on_timer(self, key: Any, timestamp_ms: int, ctx: ProcessContext) -> None:
        """Emit the left records at ``timestamp_ms - 1`` (the watermark passed them), then
        drop the versions the retention no longer needs."""
        if ctx.time_domain != "event_time":
            return
        pending, versions = ctx.map(PENDING), ctx.map(VERSIONS)
        held = versions.to_dict()
        times = sorted(held)
        t = timestamp_ms - 1
        waiting = pending.get(t)
        if waiting is not None:
            i = bisect.bisect_right(times, t)
            version = held[times[i - 1]] if i else None
            for record in waiting:
                if version is not None:
                    ctx.emit(self.select(record, version))
                elif self.how == "left":
                    ctx.emit(self.select(record, None))
            pending.remove(t)
        at_horizon = bisect.bisect_right(times, timestamp_ms - self.retention)
        for v in times[: max(at_horizon - 1, 0)]:  # all but the newest at the horizon
            versions.remove(v)


def _latest(versions: Side) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Keys, times and rows of the versions held after the batch, by key and time: of two
    at the same key and time the later row — the batch's over a stored one, a later
    record over an earlier — as a loop of ``put`` leaves them."""
    rows = np.arange(len(versions.keys))
    order = np.lexsort((rows, versions.times, versions.keys))
    keys, times, rows = versions.keys[order], versions.times[order], rows[order]
    last = np.ones(len(keys), dtype=bool)
    last[:-1] = (keys[1:] != keys[:-1]) | (times[1:] != times[:-1])
    return keys[last], times[last], rows[last]


def _newest_at(
    versions: tuple[np.ndarray, np.ndarray, np.ndarray], keys: np.ndarray, times: np.ndarray
) -> np.ndarray:
    """For each (key, time), the row of the key's newest version at or before it; -1
    where the key has none."""
    version_keys, version_times, rows = versions
    if not len(rows):
        return np.full(len(keys), -1, dtype=np.int64)
    ranks = np.unique(np.concatenate([version_times, times]))  # key * rank fits int64
    spot = version_keys * len(ranks) + np.searchsorted(ranks, version_times)
    query = keys * len(ranks) + np.searchsorted(ranks, times)
    i = np.searchsorted(spot, query, side="right") - 1  # the newest at or before
    at = np.maximum(i, 0)
    return np.where((i >= 0) & (version_keys[at] == keys), rows[at], -1)
