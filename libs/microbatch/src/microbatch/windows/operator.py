"""The window operator's logic for one batch of one instance: assign, aggregate, merge
into open windows, emit, drop late records — on columns, without Spark or storage.

Open windows live per key as ``{start: [end, partials]}`` (plain data, so they go into
keyed state as they are). A batch:

1. assigns its records to windows (:mod:`microbatch.windows.assign`); a record whose
   window had already closed when the batch started — ``end + allowed lateness <=
   watermark`` — is *late*: it is returned for the dead letters (reason ``late_window``),
   never counted;
2. reduces the rest per (key, window) with Arrow (:func:`~microbatch.windows.aggregate.
   partials`; hopping windows per pane first, :mod:`~microbatch.windows.panes`) and merges
   the partials into the open windows (sessions that now overlap or touch merge into one);
3. emits, in ``final`` mode, every window that the batch's new watermark closes, and
   forgets it — state holds open windows only; in ``updates`` mode, every window the batch
   changed (and still forgets closed ones). A window no state held that closes in the
   batch it opened in is emitted from the columns, without becoming state.

Output rows: ``key``, ``window_start``, ``window_end`` and one column per aggregate,
ordered by key then window start.
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
from collections.abc import Sequence
from typing import Any, Literal

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from microbatch.windows.aggregate import (
    END,
    FIRST_ORDER,
    FIRST_TS,
    KEY,
    ORDER,
    START,
    TS,
    Aggregate,
    arrow_needs,
    merge_partials,
    merge_table,
    mergeable,
    partial_table,
    partial_values,
    results,
)
from microbatch.windows.assign import hopping, sessions, tumbling
from microbatch.windows.panes import pane_ms, windows_of_panes
from microbatch.windows.python_merge import encode_accumulators, merge_rows
from microbatch.windows.spec import Hopping, Session, Tumbling, WindowSpec

Mode = Literal["final", "updates"]


#: key → {window start: [window end, partials]}
OpenWindows = dict[Any, dict[int, list[Any]]]


@dataclasses.dataclass(frozen=True)
class BatchOutcome:
    """A batch's emitted rows, in (key, window start) order, and its late records."""

    #: The rows of windows that state held (every row, when none were built column-wise).
    held: list[dict[str, Any]]
    #: Indices (into the batch's table) of records that came after their window closed.
    late: list[int]
    #: The rows of windows no state held, built column-wise (:meth:`WindowOperator.
    #: _emit_new_closed`), in (key, window start) order; they never become dicts unless
    #: someone asks for :attr:`rows`.
    direct: pa.Table | None = None

    def __len__(self) -> int:
        return len(self.held) + (0 if self.direct is None else self.direct.num_rows)

    @functools.cached_property
    def rows(self) -> list[dict[str, Any]]:
        """Every emitted row as a dict, in order."""
        if self.direct is None or not self.direct.num_rows:
            return self.held
        direct = self.direct.to_pylist()
        if not self.held:
            return direct
        return list(heapq.merge(direct, self.held, key=_row_order))

    def columns(self) -> pa.Table | None:
        """Every emitted row as one table, in order — None when the held rows do not fit
        the columns' types exactly (the caller then takes :attr:`rows`)."""
        direct = self.direct
        if direct is None:
            return None
        if not self.held:
            return direct
        try:
            held = pa.Table.from_pylist(self.held, schema=direct.schema)
        except (pa.ArrowException, TypeError, ValueError, OverflowError):
            return None
        if not _same_values(held.to_pylist(), self.held):
            return None
        both = pa.concat_tables([direct, held])
        return both.sort_by([("key", "ascending"), ("window_start", "ascending")])


@dataclasses.dataclass(frozen=True)
class WindowOperator:
    spec: WindowSpec
    aggregates: tuple[Aggregate, ...]
    mode: Mode = "final"
    allowed_lateness_ms: int = 0

    def run(
        self,
        table: pa.Table,
        state: OpenWindows,
        watermark_before: int | None,
        watermark_after: int | None,
    ) -> BatchOutcome:
        """One batch: ``table`` has :data:`KEY`, :data:`TS`, :data:`ORDER` and the
        aggregated columns; ``state`` is updated in place."""
        partial, late = self.pre_aggregate(table, watermark_before)
        return self.merge(partial, state, watermark_after, late, grouped=True)

    def pre_aggregate(
        self,
        table: pa.Table,
        watermark_before: int | None,
        carry: Sequence[tuple[str, str]] = (),
        encode: bool = False,
    ) -> tuple[pa.Table | None, list[int]]:
        """The records' partials per (key, window) — for sessions, per session of these
        records, with its :data:`END` — (None without records) and the indices of the late
        records: those whose every window had closed at ``watermark_before``. What
        :meth:`merge` takes, from one table or (``grouped=False``) from several.
        ``encode``: custom aggregates' records folded into encoded accumulators, as they
        cross the exchange (:func:`~microbatch.windows.python_merge.encode_accumulators`)."""
        if not table.num_rows:
            return None, []
        reads = {KEY, TS, ORDER, *(column for column, _ in arrow_needs(self.aggregates, carry))}
        table = table.select([c for c in table.column_names if c in reads])  # no other field
        pane = pane_ms(self.spec, self.aggregates, table.schema)
        if pane is not None:
            return self._pane_partials(table, watermark_before, carry, pane)
        assigned, late = self._assign(table, watermark_before)
        if not assigned.num_rows:
            return None, late
        if isinstance(self.spec, Session):
            keys = np.asarray(assigned.column(KEY).to_pylist(), dtype=object)
            ts = assigned.column(TS).to_numpy(zero_copy_only=False).astype(np.int64)
            ids, starts, ends = sessions(keys, ts, self.spec.gap_ms)
            assigned = assigned.set_column(
                assigned.schema.get_field_index(START), START, pa.array(starts[ids], pa.int64())
            ).append_column(END, pa.array(ends[ids], pa.int64()))
            carry = [*carry, (END, "max")]
        partial = partial_table(assigned, self.aggregates, carry)
        if isinstance(self.spec, Session):
            partial = partial.rename_columns(
                [END if c == f"{END}_max" else c for c in partial.column_names]
            )
        return (encode_accumulators(partial, self.aggregates) if encode else partial), late

    def fields_read(self) -> set[str]:
        """The record fields the aggregates read."""
        return {str(c) for a in self.aggregates for c, _ in a.needs() if c not in (TS, ORDER)}

    def uses_panes(self, schema: pa.Schema) -> bool:
        """Do partials of records of ``schema`` cover panes (:mod:`.panes`), with an
        :data:`END` column saying what each row covers?"""
        return pane_ms(self.spec, self.aggregates, schema) is not None

    def merge(
        self,
        partial: pa.Table | None,
        state: OpenWindows,
        watermark_after: int | None,
        late: list[int] | None = None,
        grouped: bool = False,
    ) -> BatchOutcome:
        """Partials (:meth:`pre_aggregate`'s; ``grouped``: one row per (key, window),
        else merged first, in the order of their earliest records) into the open windows,
        then the emitted rows."""
        changed: set[tuple[Any, int]] = set()
        close_at = None if watermark_after is None else watermark_after - self.allowed_lateness_ms
        at_once: pa.Table | None = None  # rows emitted column-wise
        if partial is not None and partial.num_rows and isinstance(self.spec, Session):
            changed = self._merge_sessions(state, partial)
        elif partial is not None and partial.num_rows:
            if END in partial.column_names and isinstance(self.spec, Hopping):
                partial, grouped = windows_of_panes(partial, self.spec), False
            if not grouped and mergeable(self.aggregates):
                partial, grouped = merge_table(partial, self.aggregates), True
            if grouped:
                partial, at_once = self._emit_new_closed(partial, state, close_at)
                merged_partials = partial_values(partial, self.aggregates)
            else:
                merged_partials = merge_rows(partial, self.aggregates)
            size = self.spec.size_ms
            for (key, start), values in merged_partials.items():
                windows = state.setdefault(key, {})
                old = windows.get(start)
                merged = merge_partials(self.aggregates, old[1] if old else None, values)
                windows[start] = [start + size, merged]
                changed.add((key, start))
        rows = []
        for key in sorted(state, key=_sort_key):
            windows = state[key]
            for start in sorted(windows):
                end, values = windows[start]
                closed = close_at is not None and end <= close_at  # as _closed, per window
                if closed or (self.mode == "updates" and (key, start) in changed):
                    row = {"key": key, "window_start": start, "window_end": end}
                    rows.append(row | results(self.aggregates, values))
                if closed:
                    del windows[start]
            if not windows:
                del state[key]
        return BatchOutcome(rows, list(late or []), at_once)

    def _emit_new_closed(
        self, merged: pa.Table, state: OpenWindows, close_at: int | None
    ) -> tuple[pa.Table, pa.Table | None]:
        """Of one row per (key, window): the windows no state holds yet that close now,
        as output rows built column-wise, in (key, start) order — they go out without
        becoming state — and the other rows, to merge into the open windows one by one.
        (None, all rows) when the results or the keys do not suit columns."""
        key_type = merged.schema.field(KEY).type
        names = {a.name for a in self.aggregates}
        if (
            close_at is None
            or not _ordered_keys(key_type)
            or names & {"key", "window_start", "window_end"}
        ):
            return merged, None
        results = [a.result_column(merged) for a in self.aggregates]
        if any(r is None for r in results):
            return merged, None
        starts = merged.column(START)
        now = pc.less_equal(pc.add(starts, self.spec.size_ms), close_at)  # type: ignore[union-attr]
        if state:
            try:
                held = pa.array(list(state), key_type)
            except (pa.ArrowException, TypeError, ValueError, OverflowError):
                return merged, None
            now = pc.and_(now, pc.invert(pc.is_in(merged.column(KEY), value_set=held)))
        ends = pc.add(starts, self.spec.size_ms)  # type: ignore[union-attr]
        columns = {"key": merged.column(KEY), "window_start": starts, "window_end": ends}
        columns |= {a.name: r for a, r in zip(self.aggregates, results, strict=True)}
        out = pa.table(columns).filter(now)
        out = out.sort_by([("key", "ascending"), ("window_start", "ascending")])
        return merged.filter(pc.invert(now)), out

    def _pane_partials(
        self, table: pa.Table, watermark: int | None, carry: Sequence[tuple[str, str]], pane: int
    ) -> tuple[pa.Table | None, list[int]]:
        """:meth:`pre_aggregate` per pane (:mod:`.panes`): a partial per (key, pane) of the
        records whose every window is open (the oldest window holding pane ``p`` ends at
        ``p + pane``), a partial per (key, window) of those only some of whose windows
        are, and the late records (the newest window, ending ``p + size``, closed)."""
        size = self.spec.size_ms  # type: ignore[union-attr]
        ts = table.column(TS).to_numpy(zero_copy_only=False).astype(np.int64)
        panes = ts - np.mod(ts, pane)
        whole = ~self._closed(panes + pane, watermark)
        late = self._closed(panes + size, watermark)
        parts = []
        if whole.any():
            rows = table if whole.all() else table.filter(pa.array(whole))
            rows = rows.append_column(START, pa.array(panes[whole], pa.int64()))
            parts.append(_covering(partial_table(rows, self.aggregates, carry), pane))
        partly = ~whole & ~late
        if partly.any():
            assigned, _ = self._assign(table.filter(pa.array(partly)), watermark)
            parts.append(_covering(partial_table(assigned, self.aggregates, carry), size))
        partial = pa.concat_tables(parts) if parts else None
        return partial, np.flatnonzero(late).tolist()

    def _assign(self, table: pa.Table, watermark: int | None) -> tuple[pa.Table, list[int]]:
        """The table with :data:`START` (one row per record and window; for sessions the
        record's own time, merged later) and the indices of late records: those whose
        every window had closed when the batch started."""
        ts = table.column(TS).to_numpy(zero_copy_only=False).astype(np.int64)
        if isinstance(self.spec, Session):
            rows, starts = np.arange(len(ts)), ts
            ends = ts + self.spec.gap_ms  # a session ends at least a gap after each record
        else:
            rows, starts = (tumbling if isinstance(self.spec, Tumbling) else hopping)(
                ts,
                self.spec,  # type: ignore[arg-type]
            )
            ends = starts + self.spec.size_ms
        keep = ~self._closed(ends, watermark)
        counted = np.zeros(len(ts), dtype=bool)
        counted[rows[keep]] = True
        late = np.flatnonzero(~counted).tolist()
        assigned = table.take(pa.array(rows[keep], pa.int64()))
        return assigned.append_column(START, pa.array(starts[keep], pa.int64())), late

    def _closed(self, ends: np.ndarray, watermark: int | None) -> np.ndarray:
        if watermark is None:
            return np.zeros(len(ends), dtype=bool)
        return ends + self.allowed_lateness_ms <= watermark

    def _merge_sessions(self, state: OpenWindows, partial: pa.Table) -> set[tuple[Any, int]]:
        """Session partials (of one batch's records, or fragments of them from several
        tasks) merged, in order of their earliest record, with each key's open sessions
        they overlap or touch: sessions are the connected runs of ``[ts, ts + gap)``, so
        merging fragments one by one gives the sessions of all their records."""
        partial = partial.sort_by(
            [(KEY, "ascending"), (START, "ascending"), (FIRST_TS, "ascending"),
             (FIRST_ORDER, "ascending")]
        )  # fmt: skip
        changed = set()
        for row in partial.to_pylist():
            key, start, end = row[KEY], row[START], row[END]
            values = [a.partial(row) for a in self.aggregates]
            windows = state.setdefault(key, {})
            merged: Sequence[Any] | None = None
            for s in sorted(s for s, (e, _) in windows.items() if s <= end and start <= e):
                e, p = windows.pop(s)
                changed.discard((key, s))
                start, end = min(start, s), max(end, e)
                merged = merge_partials(self.aggregates, merged, p)
            windows[start] = [end, merge_partials(self.aggregates, merged, values)]
            changed.add((key, start))
        return changed


def _covering(partial: pa.Table, width: int) -> pa.Table:
    """Partials with :data:`END`: each row covers ``[START, START + width)``."""
    return partial.append_column(END, pc.add(partial.column(START), width))  # type: ignore[attr-defined]


def _sort_key(key: Any) -> tuple[str, Any]:
    return (type(key).__name__, key)


def _row_order(row: dict[str, Any]) -> tuple[tuple[str, Any], int]:
    return _sort_key(row["key"]), row["window_start"]


def _same_values(got: list[dict[str, Any]], rows: list[dict[str, Any]]) -> bool:
    """Do ``got`` (rows back from Arrow) hold exactly ``rows``, value and type (an int
    that went into a float column, or ``2.0`` into an int one, does not)?"""
    for a, b in zip(got, rows, strict=True):
        if a != b or list(a) != list(b):
            return False
        if any(type(x) is not type(y) for x, y in zip(a.values(), b.values(), strict=True)):
            return False
    return True


def _ordered_keys(key_type: pa.DataType) -> bool:
    """Key columns whose Arrow order is Python's (:func:`_sort_key` for one key type)."""
    return bool(
        pa.types.is_integer(key_type) or pa.types.is_string(key_type)
        or pa.types.is_large_string(key_type) or pa.types.is_binary(key_type)
        or pa.types.is_large_binary(key_type)
    )  # fmt: skip
