"""Stage 2 for a windowed aggregation: the instance's records as columns through the
window operator, open windows kept in keyed state, a timer per window end.

Instead of calling ``process`` per key, the instance builds one Arrow table of its
records (key, event time, source order and the record's fields), finds the keys whose
windows the batch's watermark closes (their timers fire), runs
:class:`~microbatch.windows.operator.WindowOperator` over those keys' open windows, and
writes them back: each key's open windows in one value state, a timer at each window's
end (+ allowed lateness) so the batch that closes it loads that key. Late records become
dead letters (``late_window``) with their coordinates.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from microbatch.keygroups import decode_key
from microbatch.state import KeyedStateBackend
from microbatch.windows.aggregate import KEY, ORDER, TS
from microbatch.windows.operator import WindowOperator

#: The value state holding a key's open windows: ``{start: [end, partials]}``.
STATE = "__windows"
_PARTITION_BITS, _OFFSET_BITS = 12, 44


def _combined(column: pa.ChunkedArray | pa.Array) -> pa.Array:
    return column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column


def source_order(partition: int, offset: int) -> int:
    """A record's place in its source, comparable across batches: ties in event time go
    to the lower partition, then the lower offset."""
    return (partition << _OFFSET_BITS) | offset


def run_windows(
    operator: WindowOperator,
    backend: KeyedStateBackend,
    records: pa.Table,
    key_bytes: pa.ChunkedArray,
    partitions: pa.ChunkedArray,
    offsets: pa.ChunkedArray,
    event_ts: pa.ChunkedArray,
    watermark_before: int | None,
    watermark_after: int | None,
    emit: Callable[[dict[str, Any]], None],
    late: Callable[[str, str, int], None],
) -> dict[str, int]:
    """One instance's batch — ``records``: the records' columns, one row per record, in
    the order of ``key_bytes`` and the other columns — ; returns counters for the batch's
    stats. ``late(reason, error, row)`` dead-letters a late record."""
    n = len(key_bytes)
    encoded = _combined(key_bytes).dictionary_encode()  # keys decoded once per distinct key
    distinct = [decode_key(kb) for kb in encoded.dictionary.to_pylist()]
    closing: dict[Any, bytes] = {}
    if watermark_after is not None:
        for timer in backend.advance_watermark(watermark_after):
            closing[decode_key(timer.key_bytes)] = timer.key_bytes
    state = {}
    for key in [*distinct, *closing]:
        windows = backend.for_key(key).value(STATE).get()
        if windows:
            state[key] = {int(s): w for s, w in windows.items()}
    table = pa.table({})
    ts = _combined(event_ts).cast(pa.int64())
    if n:
        order = pc.bit_wise_or(
            pc.shift_left(_combined(partitions).cast(pa.int64()), _OFFSET_BITS),
            _combined(offsets).cast(pa.int64()),
        )
        table = pa.table({KEY: pa.array(distinct).take(encoded.indices), TS: ts, ORDER: order})
        for name in records.column_names:
            table = table.append_column(name, records.column(name))
    touched = set(distinct) | set(closing) | set(state)
    outcome = operator.run(table, state, watermark_before, watermark_after)
    for row in outcome.rows:
        emit(row)
    for i in outcome.late:
        late(
            "late_window",
            f"event time {ts[i].as_py()} falls only in windows the watermark "
            f"{watermark_before} had closed (allowed lateness {operator.allowed_lateness_ms} ms)",
            i,
        )
    lateness = operator.allowed_lateness_ms
    for key in touched:
        ctx = backend.for_key(key)
        windows = state.get(key)
        ctx.value(STATE).set(windows) if windows else ctx.value(STATE).clear()
        for end, _ in (windows or {}).values():
            ctx.register_timer(end + lateness)
    return {"windows_emitted": len(outcome.rows), "late_window": len(outcome.late)}
