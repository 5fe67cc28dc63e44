"""What every join shares: two inputs, a ``how``, dead letters, and the batch's watermark.

A join is a keyed step with two inputs: the runtime calls ``process(key, records, ctx)``
with each record wrapped as :class:`~microbatch.runtime.process.Sided` — side 0 the
stream ``join`` was called on (*left*), side 1 the other (*right*).

Joins decide lateness themselves (``late_records = True``: stage 1 hands them records
behind the watermark rather than dead-lettering them as ``late``). They judge it against
the watermark the batch *started* with, ``ctx.watermark_before``: a record is late when it
is behind that watermark for every pair it could still form, and goes to the dead letters
with reason ``late_join``. ``ctx.watermark`` (the batch's new watermark) is what the
batch's timers fire at.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, cast

import numpy as np
import pyarrow as pa

from microbatch.errors import ConfigError, ProcessError
from microbatch.joins.select import Fields
from microbatch.joins.times import EventTimeOf, RecordTimeError
from microbatch.runtime.process import KeyedBatch, KeyedProcessFunction, ProcessContext, Sided

LEFT, RIGHT = 0, 1
SIDES = ("left", "right")
LATE = "late_join"


def check_how(op: str, how: str, allowed: tuple[str, ...]) -> str:
    if how not in allowed:
        choices = " | ".join(repr(h) for h in allowed)
        raise ConfigError(f"{op} how must be {choices}: {how!r}")
    return how


def watermark_before(op: str, ctx: ProcessContext) -> int | None:
    """The watermark the batch started with (None before any event time): records behind
    it may be late. The runtime sets ``ctx.watermark_before`` for functions that take late
    records (``late_records``); without it a join cannot tell late from on time."""
    try:
        return ctx.watermark_before
    except AttributeError:
        raise ProcessError(
            f"{op} needs ctx.watermark_before, the watermark the batch started with, to "
            "judge late records; this runtime's ProcessContext has none"
        ) from None


class JoinFunction(KeyedProcessFunction):
    """Base of the join operators: splits a call's records by side, reads event times."""

    #: Stage 1 hands records behind the watermark to the join, which dead-letters only
    #: those that can join nothing more (``late_join``).
    late_records = True
    #: The inputs the step takes: side 0 (left) and side 1 (right).
    inputs = 2
    #: Needs the pipeline's event time (its timers fire by the watermark): a pipeline
    #: without one would hold records forever.
    needs_event_time = True

    @property
    def name(self) -> str:
        return type(self).__name__

    def split(self, records: Iterable[Any]) -> tuple[list[Any], list[Any]]:
        """The call's left and right records, each in the order given."""
        sides: tuple[list[Any], list[Any]] = ([], [])
        for item in records:
            if not isinstance(item, Sided):
                raise ConfigError(
                    f"{self.name} is a join: its step needs two inputs (a.key_by(...).join("
                    f"b.key_by(...), ...)); got a record without a side: {item!r:.100}"
                )
            if item.side not in (LEFT, RIGHT):
                raise ConfigError(
                    f"{self.name} joins two inputs (sides 0 and 1); got a record of input "
                    f"{item.side}"
                )
            sides[item.side].append(item.record)
        return sides

    def timed(
        self,
        ctx: ProcessContext,
        side: int,
        records: Iterable[Any],
        time_of: EventTimeOf,
    ) -> list[tuple[int, int, Any]]:
        """``(event time, position, record)`` of each record with a readable time, sorted
        by time then position; the others are dead letters (``missing_event_time``,
        ``bad_event_time``) naming the side."""
        out = []
        for position, record in enumerate(records):
            try:
                out.append((time_of(record), position, record))
            except RecordTimeError as e:
                ctx.dead_letter(e.reason, f"{self.name} {SIDES[side]} record: {e.error}", record)
        out.sort(key=lambda x: x[:2])
        return out


def rows_in_side(sides: np.ndarray) -> np.ndarray:
    """Each record's row in its side's table (:func:`side_tables`)."""
    rows = np.empty(len(sides), dtype=np.int64)
    for side in (LEFT, RIGHT):
        at = np.flatnonzero(sides == side)
        rows[at] = np.arange(len(at))
    return rows


def each_of_runs(count: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Runs of ``count[i]`` items laid end to end: each item's run ``i`` and its place
    ``j`` in the run (how a join lays out the pairs of many groups at once)."""
    run = np.repeat(np.arange(len(count)), count)
    return run, np.arange(len(run)) - np.repeat(np.cumsum(count) - count, count)


def side_tables(
    batch: KeyedBatch, select: Fields, times: tuple[str | None, str | None] = (None, None)
) -> tuple[pa.Table, pa.Table] | None:
    """Both sides' records of ``batch`` as columns holding the fields ``select`` (and each
    side's time field, ``times``) reads; a side without records, or with deletes only,
    is a table of null columns. None when a side's records are no table or lack such a
    field: the records path then takes them (and names a missing field)."""
    if batch.columns is None:
        return None
    tables = []
    for side, picked in ((LEFT, select.left), (RIGHT, select.right)):
        read = [field for _, field in picked] + ([times[side]] if times[side] else [])
        table = batch.columns.table(side)
        deleted = batch.columns.deleted(side)
        if table is None and deleted.all():
            table = pa.table({field: pa.nulls(len(deleted)) for field in dict.fromkeys(read)})
        if table is None or not all(field in table.column_names for field in read):
            return None
        tables.append(table)
    return tables[0], tables[1]


def reads_timed_columns(join: JoinFunction, select: object, *times: EventTimeOf) -> bool:
    """Can ``join`` take a batch on columns? With ``fields(...)`` for ``select`` and
    each side's time read from a field."""
    return isinstance(select, Fields) and all(isinstance(t.spec, str) for t in times)


def timed_side_tables(
    batch: KeyedBatch, select: Fields, left_time: EventTimeOf, right_time: EventTimeOf
) -> tuple[pa.Table, pa.Table, np.ndarray, np.ndarray] | None:
    """:func:`side_tables` with each side's times (:meth:`EventTimeOf.plain_column`);
    None where a side has no table or its time is no integer column."""
    spec = (cast(str, left_time.spec), cast(str, right_time.spec))
    tables = side_tables(batch, select, spec)
    if tables is None:
        return None
    left, right = tables
    lt, rt = left_time.plain_column(left), right_time.plain_column(right)
    if lt is None or rt is None:
        return None
    return left, right, lt, rt
