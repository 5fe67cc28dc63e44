"""Records of sources decoded as columns, in a dataflow whose records travel as payloads.

A source with a declared schema of several, or of a graph, or one whose
``where``/``select`` are followed by record-wise steps, is decoded as columns and goes
through its column steps, if any, in stage 1 (:func:`records_from_columns`;
:func:`~.column_plan.decoded_as_columns`); then its kept rows become records. Where every way out of
the source is keyed by a field, keys, key-groups and event times are computed column by
column and the payloads encoded as one run (:func:`_keyed_columns`): the same rows the
per-record path (``StageOne.add_records``) gives, at a third of its cost; a way into a
window that stage 1 reduces gets the partials of the kept columns instead
(:mod:`.graph_partials`). Records that need judging — no key, an event time to convert,
a late one — take that path.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from microbatch.errors import MicrobatchError
from microbatch.runtime.column_plan import columns_read_by
from microbatch.runtime.columnar import (
    add_dead_letters,
    column_steps,
    consumed_per_partition,
    decode_values,
    event_times_of,
    keys_of,
)
from microbatch.runtime.columns import ColumnStep
from microbatch.runtime.envelope import ENVELOPE_SCHEMA, RECORD, SOURCE_COLUMNS, EnvelopeBuilder
from microbatch.runtime.graph import source_of_topic
from microbatch.runtime.graph_partials import counted_rows
from microbatch.runtime.schema import ValueSchema
from microbatch.state.codec_rows import encode_rows

if TYPE_CHECKING:
    from microbatch.runtime.graph_partials import Reduction
    from microbatch.runtime.stage_one import StageOne


def records_from_columns(stage: StageOne, batch: pa.RecordBatch) -> pa.RecordBatch:
    """Kafka rows → envelope rows, in a dataflow whose records travel as payloads
    (several sources, a graph) and some of whose sources have column steps.

    Those sources' rows are decoded as columns (their ``schema_mismatch`` dead letters
    named as in :func:`decoded_values`) and go through their column steps; only the rows
    kept become records (dicts of the kept columns). Where every way out of the source
    is keyed by a field, keys, key-groups and event times are computed column by column
    and the payloads encoded as one run (:func:`_keyed_columns`); the records that need
    judging (no key, late, ...) and those of sources with record-wise steps go on as
    every source's do (``StageOne.add_records``). A row a ``where`` drops leaves no row,
    like a record-wise filter's, and is counted as consumed. The other sources' rows
    take the per-record path."""
    from microbatch.runtime.stage_one import _source_columns

    out = EnvelopeBuilder()
    topic, part = batch.column("topic"), batch.column("partition")
    index_of = source_of_topic(stage.pipeline)
    rest = np.ones(batch.num_rows, dtype=bool)
    keyed = []
    for index, steps in stage.column_sources.items():
        topics = [t for t, i in index_of.items() if i == index]
        mask = pc.is_in(topic, value_set=pa.array(topics, pa.string()))
        mask = mask.to_numpy(zero_copy_only=False)
        if mask.any():
            rest &= ~mask
            rows = _source_records(stage, out, index, steps, batch.filter(pa.array(mask)))
            if rows is not None:
                keyed.append(rows)
    if rest.any():
        others = batch.filter(pa.array(rest))
        stage.add_rows(out, *_source_columns(others))
    records = pa.concat_batches(keyed) if keyed else None
    return out.build(consumed_per_partition(topic, part), stage.parallelism, records)


def _source_records(
    stage: StageOne, out: EnvelopeBuilder, index: int, steps: Sequence[ColumnStep],
    rows: pa.RecordBatch,
) -> pa.RecordBatch | None:  # fmt: skip
    """The Kafka ``rows`` of source ``index`` (with column ``steps``) into ``out``; the
    records keyed column-wise (:func:`_keyed_columns`) are returned as rows instead."""
    from microbatch.runtime.stage_one import _Bad

    pipeline = stage.pipeline
    source = pipeline.inputs[index].source if pipeline.inputs else pipeline.source
    values = rows.column("value")
    if source.tombstones and values.null_count:  # deletes: keyed by their Kafka key
        nulls = values.is_null().to_numpy(zero_copy_only=False)
        tombstones = rows.filter(pa.array(nulls))
        for t, p, o, k in zip(*(tombstones.column(c).to_pylist() for c in SOURCE_COLUMNS[:4]),
                              strict=True):  # fmt: skip
            try:
                stage.add_tombstone(out, t, p, o, k)
            except _Bad as bad:
                out.dead(t, p, o, stage.parallelism, bad.reason, bad.error, k, None)
        rows = rows.filter(pa.array(~nulls))
        values = rows.column("value")
    keep = columns_read_by(pipeline).get(index)
    table, at, dead = decode_values(cast(ValueSchema, source.value_schema), values, keep)
    table, at = column_steps(stage, steps, table, at, rows)
    coordinates = rows.select(list(SOURCE_COLUMNS[:3])).take(pa.array(at, pa.int64()))
    keyed, rest = _keyed_columns(stage, table, coordinates)
    records = table.take(pa.array(rest)).to_pylist() if len(rest) < len(at) else table.to_pylist()
    add_records = stage.add_records
    judged = coordinates.take(pa.array(rest))
    for record, t, p, o, row in zip(
        records, *(judged.column(c).to_pylist() for c in range(3)), at[rest].tolist(), strict=True
    ):
        try:
            add_records(out, t, p, o, record)
        except _Bad as bad:
            dead[row] = (bad.reason, bad.error)
    add_dead_letters(out, dead, rows, stage.parallelism)
    if keyed is None:
        return None
    out.rows.extend(keyed.partials)
    out.counted.extend(keyed.counted)
    if not keyed.ways:
        return None
    return _with_coordinates(keyed, rows.take(pa.array(at[keyed.rows], pa.int64())))


class _Keyed:
    """Records keyed column-wise: per way out that takes records, the envelope columns
    but the source coordinates, of the records at ``rows`` (positions in the decoded
    table); and the ``partial`` rows of the ways into windows stage 1 reduces, with the
    rows their records count as in the ``stat`` rows (:mod:`.graph_partials`)."""

    def __init__(self, rows: np.ndarray) -> None:
        self.rows = rows
        self.ways: list[dict[str, Any]] = []
        self.partials: list[tuple[Any, ...]] = []
        self.counted: list[pa.RecordBatch] = []


def _ways(
    stage: StageOne, topic: str
) -> list[tuple[str, int | None, str | None, Reduction | None]] | None:
    """(key field, late before, marker, reduction or None) of each way a record of
    ``topic`` goes on, or None when one needs the per-record path: a record-wise step, a
    computed key, a sink fed by the source."""
    if stage._source_taps.get(topic):
        return None
    if stage.pipeline.edges:
        routes = stage._routes[topic]
        if any(r.edge.chain or r.field is None for r in routes):
            return None
        return [(cast(str, r.field), r.late_before, r.marker, r.reduce) for r in routes]
    if stage.prefix_of(topic) or stage._key_field is None:
        return None
    return [(stage._key_field, stage._late_before, None, None)]


def _keyed_columns(
    stage: StageOne, table: pa.Table, coordinates: pa.RecordBatch
) -> tuple[_Keyed | None, np.ndarray]:
    """Key, key-group, event time and payload of a source's decoded records (read at
    ``coordinates``: topic, partition, offset, row for row), column by column, for every
    way out (:func:`_ways`) — a window's that stage 1 reduces as partials; and the
    positions of the records the per-record path must judge (``StageOne.add_records``):
    a missing key or event time, an ISO-8601 one, a late record, a value the codec
    refuses, a topic whose records go through record-wise steps. The rows are those the
    per-record path gives."""
    n = table.num_rows
    everything = np.arange(n)
    distinct = pc.unique(coordinates.column("topic")).to_pylist() if n else []
    if len(distinct) != 1:  # none, or several topics of one source (rare): one by one
        return None, everything
    topic = distinct[0]
    ways = _ways(stage, topic)
    if ways is None or any(way[0] not in table.column_names for way in ways):
        return None, everything
    slow = np.zeros(n, dtype=bool)
    keys = [keys_of(stage, table.column(way[0])) for way in ways]
    for _, _, null in keys:
        slow |= null
    ts = event_times_of(stage, table, slow, None)
    for _, late_before, _, _ in ways:
        if ts is not None and late_before is not None:
            slow |= ts < late_before
    keep = np.nonzero(~slow)[0]
    taken = pa.array(keep)
    kept_ts = None if ts is None else ts[keep]
    keyed = _Keyed(keep)
    parts, offs = (coordinates.column(c).take(taken).to_numpy() for c in ("partition", "offset"))
    record_ways = []
    for (kbs, kgs, _), (_, _, marker, reduction) in zip(keys, ways, strict=True):
        groups, key = kgs[keep].astype(np.int32), kbs.take(taken)
        if reduction is not None and kept_ts is not None and len(keep):  # a window's partials
            marked = topic if marker is None else marker
            fields = {f: table.column(f).take(taken) for f in reduction.operator.fields_read()
                      if f in table.column_names}  # fmt: skip
            partials = reduction.of_columns(marked, fields, key, groups, kept_ts, parts, offs)
            if partials is not None:
                keyed.partials.extend(partials)
                keyed.counted.append(counted_rows(marked, parts, offs, kept_ts))
                continue
        record_ways.append((marker, groups, key))
    if record_ways:
        try:
            payloads = encode_rows(table.take(taken))  # from the buffers: no dict per row
        except MicrobatchError:  # a value the codec refuses: a dead letter, one by one
            return None, everything
    instance_of = np.asarray(stage._instance_of, dtype=np.int32)
    for marker, groups, key in record_ways:
        keyed.ways.append({
            "marker": marker,
            "instance": pa.array(instance_of[groups]),
            "key_group": pa.array(groups),
            "key": key,
            "event_ts": pa.nulls(len(keep), pa.int64()) if kept_ts is None
            else pa.array(kept_ts, pa.int64()),
            "payload": payloads,
        })  # fmt: skip
    return keyed, np.nonzero(slow)[0]


def _with_coordinates(keyed: _Keyed, source: pa.RecordBatch) -> pa.RecordBatch:
    """``keyed``'s envelope rows, with the source coordinates of its records."""
    n = len(keyed.rows)
    batches = []
    for way in keyed.ways:
        topic = source.column("topic")
        if way["marker"] is not None:
            topic = pa.repeat(pa.scalar(way["marker"], pa.string()), n)
        arrays = [
            pa.repeat(pa.scalar(RECORD, pa.string()), n),
            topic,
            source.column("partition"),
            source.column("offset"),
            pa.array(np.zeros(n, dtype=np.int32)),
            way["instance"],
            way["key_group"],
            way["key"],
            way["event_ts"],
            way["payload"],
        ]
        batches.append(pa.RecordBatch.from_arrays(arrays, schema=ENVELOPE_SCHEMA))
    return pa.concat_batches(batches)
