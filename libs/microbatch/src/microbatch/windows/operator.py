"""The window operator's logic for one batch of one instance: assign, aggregate, merge
into open windows, emit, drop late records — on columns, without Spark or storage.

Open windows live per key as ``{start: [end, partials]}`` (plain data, so they go into
keyed state as they are). A batch:

1. assigns its records to windows (:mod:`microbatch.windows.assign`); a record whose
   window had already closed when the batch started — ``end + allowed lateness <=
   watermark`` — is *late*: it is returned for the dead letters (reason ``late_window``),
   never counted;
2. reduces the rest per (key, window) with Arrow (:func:`~microbatch.windows.aggregate.
   partials`) and merges the partials into the open windows (sessions that now overlap or
   touch merge into one);
3. emits, in ``final`` mode, every window that the batch's new watermark closes, and
   forgets it — state holds open windows only; in ``updates`` mode, every window the batch
   changed (and still forgets closed ones).

Output rows: ``key``, ``window_start``, ``window_end`` and one column per aggregate,
ordered by key then window start.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Literal

import numpy as np
import pyarrow as pa

from microbatch.windows.aggregate import (
    KEY,
    START,
    TS,
    Aggregate,
    merge_partials,
    partials,
    results,
)
from microbatch.windows.assign import hopping, sessions, tumbling
from microbatch.windows.spec import Session, Tumbling, WindowSpec

Mode = Literal["final", "updates"]
#: key → {window start: [window end, partials]}
OpenWindows = dict[Any, dict[int, list[Any]]]


@dataclasses.dataclass(frozen=True)
class BatchOutcome:
    rows: list[dict[str, Any]]
    #: Indices (into the batch's table) of records that came after their window closed.
    late: list[int]


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
        changed: set[tuple[Any, int]] = set()
        assigned, late = self._assign(table, watermark_before) if table.num_rows else (table, [])
        if assigned.num_rows and isinstance(self.spec, Session):
            changed = self._merge_sessions(state, assigned)
        elif assigned.num_rows:
            size = self.spec.size_ms
            for (key, start), partial in partials(assigned, self.aggregates).items():
                windows = state.setdefault(key, {})
                old = windows.get(start)
                merged = merge_partials(self.aggregates, old[1] if old else None, partial)
                windows[start] = [start + size, merged]
                changed.add((key, start))
        rows = []
        close_at = None if watermark_after is None else watermark_after - self.allowed_lateness_ms
        for key in sorted(state, key=_sort_key):
            windows = state[key]
            for start in sorted(windows):
                end, partial = windows[start]
                closed = close_at is not None and end <= close_at  # as _closed, per window
                if closed or (self.mode == "updates" and (key, start) in changed):
                    row = {"key": key, "window_start": start, "window_end": end}
                    rows.append(row | results(self.aggregates, partial))
                if closed:
                    del windows[start]
            if not windows:
                del state[key]
        return BatchOutcome(rows, late)

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

    def _merge_sessions(self, state: OpenWindows, assigned: pa.Table) -> set[tuple[Any, int]]:
        """Sessions of the batch (records within the gap merged), then merged with each
        key's open sessions they overlap or touch."""
        assert isinstance(self.spec, Session)
        keys = np.asarray(assigned.column(KEY).to_pylist(), dtype=object)
        ts = assigned.column(TS).to_numpy(zero_copy_only=False).astype(np.int64)
        ids, starts, ends = sessions(keys, ts, self.spec.gap_ms)
        grouped = assigned.set_column(
            assigned.schema.get_field_index(START), START, pa.array(starts[ids], pa.int64())
        )
        _, first_record = np.unique(ids, return_index=True)
        end_of = {
            (keys[first_record[sid]], start): end
            for sid, (start, end) in enumerate(zip(starts.tolist(), ends.tolist(), strict=True))
        }
        changed = set()
        for (key, start), partial in partials(grouped, self.aggregates).items():
            end = end_of[key, start]
            windows = state.setdefault(key, {})
            merged: Sequence[Any] | None = None
            for s in sorted(s for s, (e, _) in windows.items() if s <= end and start <= e):
                e, p = windows.pop(s)
                changed.discard((key, s))
                start, end = min(start, s), max(end, e)
                merged = merge_partials(self.aggregates, merged, p)
            windows[start] = [end, merge_partials(self.aggregates, merged, partial)]
            changed.add((key, start))
        return changed


def _sort_key(key: Any) -> tuple[str, Any]:
    return (type(key).__name__, key)
