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

import json
from collections.abc import Callable, Sequence
from typing import Any

import pyarrow as pa

from microbatch.keygroups import decode_key
from microbatch.state import KeyedStateBackend
from microbatch.windows.aggregate import KEY, ORDER, TS
from microbatch.windows.operator import WindowOperator

#: The value state holding a key's open windows: ``{start: [end, partials]}``.
STATE = "__windows"
_PARTITION_BITS, _OFFSET_BITS = 12, 44


def source_order(partition: int, offset: int) -> int:
    """A record's place in its source, comparable across batches: ties in event time go
    to the lower partition, then the lower offset."""
    return (partition << _OFFSET_BITS) | offset


def run_windows(
    operator: WindowOperator,
    backend: KeyedStateBackend,
    records: Sequence[dict[str, Any]],
    key_bytes: Sequence[bytes],
    coordinates: Sequence[tuple[str, int, int]],
    event_ts: Sequence[int],
    watermark_before: int | None,
    watermark_after: int | None,
    emit: Callable[[dict[str, Any]], None],
    dead_letter: Callable[..., None],
) -> dict[str, int]:
    """One instance's batch; returns counters for the batch's stats."""
    keys_of = {kb: decode_key(kb) for kb in dict.fromkeys(key_bytes)}  # once per distinct key
    closing: dict[Any, bytes] = {}
    if watermark_after is not None:
        for timer in backend.advance_watermark(watermark_after):
            closing[decode_key(timer.key_bytes)] = timer.key_bytes
    state = {}
    for key in [*keys_of.values(), *closing]:
        windows = backend.for_key(key).value(STATE).get()
        if windows:
            state[key] = {int(s): w for s, w in windows.items()}
    table = pa.Table.from_pylist(list(records)) if records else pa.table({})
    if records:
        table = (
            table.append_column(KEY, pa.array([keys_of[kb] for kb in key_bytes]))
            .append_column(TS, pa.array(event_ts, pa.int64()))
            .append_column(
                ORDER, pa.array([source_order(p, o) for _, p, o in coordinates], pa.int64())
            )
        )
    touched = set(keys_of.values()) | set(closing) | set(state)
    outcome = operator.run(table, state, watermark_before, watermark_after)
    for row in outcome.rows:
        emit(row)
    for i in outcome.late:
        topic, partition, offset = coordinates[i]
        dead_letter(
            "late_window",
            f"event time {event_ts[i]} falls only in windows the watermark "
            f"{watermark_before} had closed (allowed lateness {operator.allowed_lateness_ms} ms)",
            topic=topic,
            partition=partition,
            offset=offset,
            raw_value=json.dumps(records[i], default=str).encode(),
        )
    lateness = operator.allowed_lateness_ms
    for key in touched:
        ctx = backend.for_key(key)
        windows = state.get(key)
        ctx.value(STATE).set(windows) if windows else ctx.value(STATE).clear()
        for end, _ in (windows or {}).values():
            ctx.register_timer(end + lateness)
    return {"windows_emitted": len(outcome.rows), "late_window": len(outcome.late)}
