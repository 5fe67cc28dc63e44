"""Stage 2 for a windowed aggregation: the instance's records as columns through the
window operator, open windows kept in keyed state, a timer per key.

Instead of calling ``process`` per key, the instance builds one Arrow table of its
records (key, event time, source order and the record's fields), finds the keys whose
windows the batch's watermark closes (their timers fire), runs
:class:`~microbatch.windows.operator.WindowOperator` over those keys' open windows, and
writes back the keys that held or hold open windows: each key's open windows in one
value state, a timer at the end (+ allowed lateness) of the first of them to close, so the
batch that closes it loads that key (and registers the next one). Windows that open and
close within one batch never become state (the operator emits them column-wise). Late
records become dead letters (``late_window``) with their coordinates.

**Local-global aggregation** (:func:`pre_aggregation`): for a pipeline with a declared
value schema whose first keyed step is a window whose aggregates merge, stage 1
reduces its task's records to partials per (key, window) — per session fragment for
sessions — with the operator's own group-by (:func:`stage_one_partials`), and decides
lateness against the batch's starting watermark exactly as stage 2 would (late records
become ``late_window`` dead letters there, with the same error). Only ``partial`` rows
cross the exchange: the key once, the window start (and a session's end), the partial
columns (:func:`exchange_schema`); no topic, offsets or record fields. A custom
aggregate's partial is its accumulator, folded in stage 1 and encoded with the state's
codec; ``collect``'s is the records' values with their event times and source order.
Stage 2 (:func:`run_partials`) merges the partials of every task in the order of their
earliest records — with a second group-by when every aggregate merges column-wise, else
in Python with each aggregate's ``merge`` — then into the open windows as before. Keyed
steps chained after the window (a dataflow) read its emitted rows, keyed for them after
it as without partials: only the first exchange changes. The ``stat`` rows are counted
on the records, before they are reduced, so the watermark and the batch's counts are
what they were.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, cast

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from microbatch.keygroups import decode_key
from microbatch.runtime.column_plan import columnar_values
from microbatch.runtime.envelope import (
    DEAD_LETTER,
    ENVELOPE_SCHEMA,
    PARTIAL,
    DeadLetterDetail,
    EnvelopeBuilder,
    envelope_schema,
    unkeyed_instance,
)
from microbatch.runtime.pipeline import Pipeline
from microbatch.state import KeyedStateBackend
from microbatch.windows.aggregate import (
    END,
    KEY,
    ORDER,
    START,
    TS,
    partial_table,
    pre_aggregable,
)
from microbatch.windows.operator import BatchOutcome, OpenWindows, WindowOperator
from microbatch.windows.python_merge import encode_accumulators
from microbatch.windows.spec import Session

#: Pre-aggregate windows in stage 1 where :func:`pre_aggregation` allows it.
PRE_AGGREGATE = True
#: Prefix of the exchange columns holding a partial's window and partial values.
PARTIAL_PREFIX = "partial_"

#: The value state holding a key's open windows: ``{start: [end, partials]}``.
STATE = "__windows"
_PARTITION_BITS, _OFFSET_BITS = 12, 44


def _combined(column: pa.ChunkedArray | pa.Array) -> pa.Array:
    return column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column


def source_order(partition: int, offset: int) -> int:
    """A record's place in its source, comparable across batches: ties in event time go
    to the lower partition, then the lower offset."""
    return (partition << _OFFSET_BITS) | offset


def source_orders(partitions: Any, offsets: Any) -> pa.Array:
    """:func:`source_order` of each record, over columns (Arrow, numpy or lists)."""

    def int64(values: Any) -> pa.Array:
        if isinstance(values, pa.Array | pa.ChunkedArray):
            return _combined(values).cast(pa.int64())
        return pa.array(np.asarray(values, np.int64))

    return pc.bit_wise_or(pc.shift_left(int64(partitions), _OFFSET_BITS), int64(offsets))


def pre_aggregation(pipeline: Pipeline, enabled: bool | None = None) -> WindowOperator | None:
    """The window operator whose partials stage 1 computes, or None: only for a pipeline
    whose records travel as columns (a declared schema, no enrichment or stateless
    steps), whose first keyed step is a window whose aggregates merge
    (:func:`~microbatch.windows.aggregate.pre_aggregable`: column-wise ones, ``collect``,
    custom aggregates that opt in with ``pre_aggregate=True``) and sums no
    floating-point column: a float sum depends on the order of its terms, and the results
    must be the records path's to the bit. Further keyed steps may follow as a chain
    (each reads the step before): they get the window's emitted rows, keyed for them
    after the first exchange. Not a graph (``edges``): there a source may feed a later
    step, its records riding through the first exchange, which carries only partials.
    ``enabled``: None, as :data:`PRE_AGGREGATE` says (read when called: the driver
    decides, the tasks follow)."""
    process = pipeline.process
    operator = getattr(process, "operator", None)
    if (
        not (PRE_AGGREGATE if enabled is None else enabled)
        or not getattr(process, "columnar", False)
        or not isinstance(operator, WindowOperator)
        or pipeline.edges
        or columnar_values(pipeline) is None
        or not pre_aggregable(operator.aggregates)
    ):
        return None
    values = columnar_values(pipeline)
    for column, fn in (n for a in operator.aggregates for n in a.needs()):
        if fn == "sum" and pa.types.is_floating(values.field(column).type):
            return None
    return operator


def _partial_columns(operator: WindowOperator, values: pa.Schema) -> pa.Schema:
    """The partial table's columns but the key (their types: what the group-by gives for
    the declared fields' types), from an empty table; with :data:`END` for sessions and
    for hopping windows reduced per pane (what each row covers)."""
    empty = pa.table(
        {KEY: pa.array([], pa.binary()), TS: pa.array([], pa.int64()),
         ORDER: pa.array([], pa.int64()), START: pa.array([], pa.int64()),
         **({END: pa.array([], pa.int64())} if isinstance(operator.spec, Session) else {}),
         **{f.name: pa.array([], f.type) for f in values}}
    )  # fmt: skip
    carry = [(END, "max")] if isinstance(operator.spec, Session) else []
    table = encode_accumulators(
        partial_table(empty, operator.aggregates, carry), operator.aggregates
    )
    named = {f"{END}_max": END}  # as WindowOperator.pre_aggregate names it
    fields = [f.with_name(named.get(f.name, f.name)) for f in table.schema if f.name != KEY]
    if operator.uses_panes(values):
        fields.append(pa.field(END, pa.int64()))
    return pa.schema(fields)


def exchange_schema(pipeline: Pipeline, enabled: bool | None = None) -> pa.Schema:
    """The schema of the rows between stage 1 and stage 2: the envelope's, with the
    declared fields' columns (:func:`~microbatch.runtime.envelope.envelope_schema`), or —
    when stage 1 pre-aggregates windows — with a ``partial_<column>`` per partial column
    instead (no record travels, only partials)."""
    values = columnar_values(pipeline)
    operator = pre_aggregation(pipeline, enabled)
    if operator is None:
        return envelope_schema(values)
    partial = _partial_columns(operator, values)
    fields = [pa.field(PARTIAL_PREFIX + f.name, f.type) for f in partial]
    return pa.schema([*ENVELOPE_SCHEMA, *fields])


def _partial_names(schema: pa.Schema) -> dict[str, str]:
    """Exchange column → partial table column (``partial___window_start`` →
    ``__window_start``)."""
    n = len(PARTIAL_PREFIX)
    return {f.name: f.name[n:] for f in schema if f.name.startswith(PARTIAL_PREFIX)}


def carries_partials(table: pa.Table) -> bool:
    """Are ``table``'s rows those of a pre-aggregating stage 1 (:func:`exchange_schema`)?"""
    return any(name.startswith(PARTIAL_PREFIX) for name in table.column_names)


def late_error(ts: int, watermark_before: int | None, lateness_ms: int) -> str:
    return (
        f"event time {ts} falls only in windows the watermark {watermark_before} had closed "
        f"(allowed lateness {lateness_ms} ms)"
    )


def stage_one_partials(
    operator: WindowOperator,
    records: pa.RecordBatch,
    fields: pa.Table,
    watermark: int | None,
    instance_of: np.ndarray,
    parallelism: int,
    schema: pa.Schema,
    uid: str | None,
    late_fields: Callable[[pa.Array], pa.Table] | None = None,
) -> pa.RecordBatch:
    """One stage-1 task's keyed ``records`` (envelope rows; ``fields``: their declared
    fields, row for row — those the aggregates read at least) as ``partial`` rows in
    ``schema`` (:func:`exchange_schema`), one per (key, window) or session fragment,
    routed to the key's instance; followed by the ``late_window`` dead letters of the
    records whose every window had closed at ``watermark`` (the batch's starting one), as
    stage 2 would have set them aside, with every declared field (``late_fields``: those
    of the records at the given rows; default: ``fields``')."""
    order = source_orders(records.column("partition"), records.column("offset"))
    table = pa.table(
        {KEY: records.column("key"), TS: records.column("event_ts"), ORDER: order,
         "__kg": records.column("key_group"), **{n: fields.column(n) for n in fields.column_names}}
    )  # fmt: skip
    partial, late = operator.pre_aggregate(table, watermark, [("__kg", "min")], encode=True)
    n = 0 if partial is None else partial.num_rows
    names = {v: k for k, v in _partial_names(schema).items()}
    if partial is not None and END in partial.column_names and END not in names:
        raise ValueError(  # the driver and the task must agree on what a partial covers
            f"step {uid!r}: stage 1's window partials cover panes, but the exchange schema "
            "has no column for their end; the driver and the tasks run different versions"
        )
    columns: dict[str, Any] = {f.name: pa.nulls(n, f.type) for f in schema}
    columns["kind"] = pa.array([PARTIAL] * n, pa.string())
    if partial is not None:
        kgs = partial.column("__kg_min").to_numpy(zero_copy_only=False)
        columns["instance"] = pa.array(instance_of[kgs], pa.int32())
        columns["key"] = partial.column(KEY)
        for name in partial.column_names:
            if name in names:
                columns[names[name]] = partial.column(name)
    out = pa.RecordBatch.from_pydict(
        {
            k: v.combine_chunks() if isinstance(v, pa.ChunkedArray) else v
            for k, v in columns.items()
        },
        schema=schema,
    )
    if not late:
        return out
    dead = EnvelopeBuilder(schema)
    rows = (late_fields or fields.take)(pa.array(late, pa.int64())).to_pylist()
    at = records.select(["topic", "partition", "offset", "event_ts"]).take(pa.array(late))
    coords = zip(*at.to_pydict().values(), strict=True)
    for record, (topic, part, off, ts) in zip(rows, coords, strict=True):
        error = late_error(ts, watermark, operator.allowed_lateness_ms)
        raw = json.dumps(record, default=str).encode()
        detail = DeadLetterDetail("late_window", error, None, raw, None, uid).to_payload()
        inst = unkeyed_instance(part, off, parallelism)
        dead.add(DEAD_LETTER, topic, part, off, 0, inst, None, None, None, detail)
    return pa.concat_batches([out, dead.rows_batch()])


def partial_keys(table: pa.Table, reduced: pa.Table | None = None) -> list[bytes]:
    """The distinct key bytes of ``table``'s ``partial`` rows and of ``reduced`` (a
    graph's partials, :func:`~.graph_partials.reduced_partials`): keys whose open windows
    the batch loads, as it loads those of its records."""
    if reduced is not None:
        return cast("list[bytes]", pc.unique(reduced.column(KEY)).to_pylist())
    rows = table.filter(pc.equal(table.column("kind"), PARTIAL))
    return cast("list[bytes]", pc.unique(rows.column("key")).to_pylist())


def run_partials(
    operator: WindowOperator,
    backend: KeyedStateBackend,
    table: pa.Table,
    watermark_after: int | None,
    emit: Callable[[BatchOutcome], None],
) -> dict[str, int]:
    """Stage 2 of a pre-aggregated window: the ``partial`` rows of every stage-1 task
    (``table``: the instance's exchange rows) merged into the keys' open windows."""
    rows = table.filter(pc.equal(table.column("kind"), PARTIAL))
    names = _partial_names(table.schema)
    partial = rows.select(list(names)).rename_columns(list(names.values()))
    encoded = rows.column("key").combine_chunks().dictionary_encode()
    distinct = [decode_key(kb) for kb in encoded.dictionary.to_pylist()]
    partial = partial.append_column(KEY, pa.array(distinct).take(encoded.indices))
    state = _load(backend, distinct, encoded.dictionary, watermark_after)
    held = set(state)
    outcome = operator.merge(partial if rows.num_rows else None, state, watermark_after)
    _store(operator, backend, state, held, outcome, emit)
    return {"windows_emitted": len(outcome), "partials": rows.num_rows}


def _load(
    backend: KeyedStateBackend, keys: list[Any], key_bytes: pa.Array, watermark: int | None
) -> OpenWindows:
    """The open windows of ``keys`` (``key_bytes``: theirs, in order) and of the keys
    whose windows ``watermark`` closes (their timers fire). Only keys the backend holds
    windows of are read: the rest have none (a batch's keys are loaded before it runs)."""
    closing: dict[Any, bytes] = {}
    if watermark is not None:
        for timer in backend.advance_watermark(watermark):
            closing[decode_key(timer.key_bytes)] = timer.key_bytes
    stored: set[bytes] = set()
    for kg in backend.key_groups:
        stored.update(backend.table(kg, STATE) or ())
    held = [k for k, kb in zip(keys, key_bytes.to_pylist(), strict=True) if kb in stored]
    state = {}
    for key in [*held, *closing]:
        windows = backend.for_key(key).value(STATE).get()
        if windows:
            state[key] = {int(s): w for s, w in windows.items()}
    return state


def _store(
    operator: WindowOperator,
    backend: KeyedStateBackend,
    state: OpenWindows,
    held: set[Any],
    outcome: BatchOutcome,
    emit: Callable[[BatchOutcome], None],
) -> None:
    """Emit the batch's rows (``outcome``, all at once); write back the open windows and
    timers of the keys that held windows before the batch (``held``) or hold some now — a
    key in neither has no state to write or clear."""
    emit(outcome)
    lateness = operator.allowed_lateness_ms
    for key in held | set(state):
        ctx = backend.for_key(key)
        windows = state.get(key)
        ctx.value(STATE).set(windows) if windows else ctx.value(STATE).clear()
        if windows:  # the first to close loads the key; it then registers the next
            ctx.register_timer(min(end for end, _ in windows.values()) + lateness)


def with_partials(operator: WindowOperator, own: pa.Table | None, reduced: pa.Table) -> pa.Table:
    """A batch's partials of its records (``own``, stage 2's) and stage 1's (``reduced``,
    its keys decoded as ``own``'s) as one table for ``WindowOperator.merge``. A row
    without :data:`END` (a float sum's partials are per window, not per pane) covers its
    whole window."""
    merged = pa.concat_tables(
        [t for t in (own, reduced) if t is not None], promote_options="permissive"
    )
    if END in merged.column_names and merged.column(END).null_count:
        whole = pc.add(merged.column(START), operator.spec.size_ms)  # type: ignore[union-attr]
        end = pc.coalesce(merged.column(END), whole)
        merged = merged.set_column(merged.schema.get_field_index(END), END, end)
    return merged


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
    emit: Callable[[BatchOutcome], None],
    late: Callable[[str, str, int], None],
    reduced: pa.Table | None = None,
) -> dict[str, int]:
    """One instance's batch — ``records``: the records' columns, one row per record, in
    the order of ``key_bytes`` and the other columns; ``reduced``: partials stage 1
    reduced other records to (:mod:`.graph_partials`) — ; returns counters for the
    batch's stats. ``late(reason, error, row)`` dead-letters a late record."""
    n = len(key_bytes)
    every_key = _combined(key_bytes)
    if reduced is not None:
        every_key = pa.concat_arrays([every_key, _combined(reduced.column(KEY))])
    encoded = every_key.dictionary_encode()  # keys decoded once per distinct key
    keys = [decode_key(kb) for kb in encoded.dictionary.to_pylist()]
    state = _load(backend, keys, encoded.dictionary, watermark_after)
    distinct = pa.array(keys)  # the KEY column's values, of the records and the partials
    table = pa.table({})
    ts = _combined(event_ts).cast(pa.int64())
    if n:
        order = source_orders(partitions, offsets)
        table = pa.table({KEY: distinct.take(encoded.indices.slice(0, n)), TS: ts, ORDER: order})
        for name in records.column_names:
            table = table.append_column(name, records.column(name))
    held = set(state)
    if reduced is None:
        outcome = operator.run(table, state, watermark_before, watermark_after)
    else:
        own, late_rows = operator.pre_aggregate(table, watermark_before)
        theirs = reduced.set_column(
            reduced.schema.get_field_index(KEY), KEY, distinct.take(encoded.indices.slice(n))
        )
        partial = with_partials(operator, own, theirs)
        outcome = operator.merge(partial, state, watermark_after, late_rows)
    _store(operator, backend, state, held, outcome, emit)
    counters = {"windows_emitted": len(outcome), "late_window": len(outcome.late)}
    if reduced is not None:
        counters["partials"] = reduced.num_rows
    for i in outcome.late:
        late(
            "late_window",
            late_error(ts[i].as_py(), watermark_before, operator.allowed_lateness_ms),
            i,
        )
    return counters
