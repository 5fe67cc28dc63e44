"""Sinks fed by a source as columns: a dataflow without keyed steps whose source declares
a ``value_schema`` (``flow.source(s).where(...).select(...).to(sink)``).

Stage 1 (:func:`tap_envelopes`) decodes a Kafka batch into columns, runs each sink's
column steps on them and sends the rows as ``output`` envelope rows that carry the
columns (``value_<field>``, no payload; ``key`` holds the sink's name), each to the
instance :func:`~microbatch.runtime.envelope.unkeyed_instance` picks by source position.
Stage 2 (:func:`tap_tables`) hands each sink one Arrow table per instance and batch, in
source order (topic, partition, offset), which the sink's ``stage_columns`` stages: no
Python object per record on the way (unless the sink writes records, not tables). Dead
letters (values that do not match the schema, tombstones) are those of the keyed
columnar path (:mod:`.columnar`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from microbatch.runtime.column_plan import columnar_values, tap_values
from microbatch.runtime.columnar import (
    add_dead_letters,
    column_steps,
    consumed_per_partition,
    decoded_values,
)
from microbatch.runtime.envelope import (
    ENVELOPE_SCHEMA,
    OUTPUT,
    SOURCE_COLUMNS,
    VALUE_PREFIX,
    EnvelopeBuilder,
    envelope_schema,
    value_columns,
)

if TYPE_CHECKING:
    from microbatch.runtime.stage_one import StageOne

__all__ = ["tap_envelopes", "tap_tables"]


def tap_envelopes(stage: StageOne, batch: pa.RecordBatch) -> pa.RecordBatch:
    """Kafka rows (:data:`SOURCE_COLUMNS`) → ``output`` rows per sink, as columns."""
    pipeline = stage.pipeline
    out = EnvelopeBuilder(envelope_schema(columnar_values(pipeline)))
    topic, part, off, _, rvalue = (batch.column(c) for c in SOURCE_COLUMNS)
    table, rows, dead = decoded_values(pipeline, rvalue)
    sinks = tap_values(pipeline) or {}
    n_routing = len(ENVELOPE_SCHEMA)
    outputs = []
    for tap in pipeline.source_taps:
        kept, at = column_steps(stage, tap.columns, table, rows, batch)
        take = pa.array(at, pa.int64())
        n = len(at)
        parts, offs = part.take(take), off.take(take)
        # unkeyed_instance's spread, for every row at once
        spread = parts.to_numpy(zero_copy_only=False) + offs.to_numpy(zero_copy_only=False)
        columns = [
            pa.repeat(OUTPUT, n),
            topic.take(take),
            parts,
            offs,
            pa.array(np.zeros(n, dtype=np.int32)),
            pa.array((spread % stage.parallelism).astype(np.int32)),
            pa.nulls(n, pa.int32()),
            pa.repeat(pa.scalar(tap.sink.encode(), pa.binary()), n),
            pa.nulls(n, pa.int64()),
            pa.nulls(n, pa.binary()),
        ]
        own = set(sinks[tap.sink].names)
        for field in list(out.schema)[n_routing:]:
            name = field.name[len(VALUE_PREFIX) :]
            columns.append(
                kept.column(name).combine_chunks() if name in own else pa.nulls(n, field.type)
            )
        outputs.append(pa.RecordBatch.from_arrays(columns, schema=out.schema))
    add_dead_letters(out, dead, batch, stage.parallelism)
    records = pa.concat_batches(outputs) if outputs else None
    return out.build(consumed_per_partition(topic, part), stage.parallelism, records)


def tap_tables(pipeline: Any, rows: pa.Table) -> dict[str, pa.Table]:
    """An instance's ``output`` rows (in source order) as one table per sink."""
    sinks = tap_values(pipeline) or {}
    names = rows.column("key")
    tables = {}
    for sink, columns in sinks.items():
        mine = pc.equal(names, sink.encode())
        # One sink's rows are all of them: kept as they are, not copied.
        tables[sink] = value_columns(rows if pc.all(mine).as_py() else rows.filter(mine), columns)
    return tables
