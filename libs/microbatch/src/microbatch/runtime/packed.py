"""Records for the next keyed step, packed: a few rows per next instance, each holding
thousands of envelope rows as one Arrow IPC stream.

Spark moves the rows of an exchange one by one: a ``mapInArrow`` body's output becomes
JVM rows, is shuffled, and becomes Arrow again for the next body. For a step that hands
on 600k rows a batch (Nexmark q5's counts per auction and window), that per-row work
cost more than the step itself. So stage 1's records and partials, and each keyed
step's records, go out as ``packed`` rows instead — ``instance``: the next instance
they are all for, ``payload``: their envelope rows (on the wire codes) as an IPC stream
of at most :data:`PACK_ROWS` rows — and :func:`unpacked` restores them where the next
body receives its partition, before it looks at a single row. Only the Arrow buffers
are copied on either side.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from microbatch.errors import BatchError
from microbatch.runtime.envelope import ENVELOPE_SCHEMA, PACKED, PARTIAL, RECORD
from microbatch.runtime.wire import Tags, tags_of

if TYPE_CHECKING:
    from microbatch.runtime.pipeline import Pipeline

#: Envelope rows per packed row: ~3 MB of q5's rows, far below what Spark handles as
#: one value, and enough that the JVM's work per packed row does not count.
PACK_ROWS = 32_768


def packed(rows: pa.RecordBatch | pa.Table, tags: Tags) -> pa.RecordBatch:
    """``rows`` (envelope rows, plain or on the wire) as packed rows, one or more per
    instance, plain (the caller puts them on the wire with the rest)."""
    schema = pa.schema(
        [ENVELOPE_SCHEMA.field(f.name) if f.name in ENVELOPE_SCHEMA.names else f
         for f in rows.schema]
    )  # fmt: skip
    if not rows.num_rows:
        return pa.RecordBatch.from_pylist([], schema=schema)
    wire = tags.to_wire(rows)
    instances = rows.column("instance").to_numpy(zero_copy_only=False)
    order = np.argsort(instances, kind="stable")
    ordered = instances[order]
    bounds = np.flatnonzero(np.r_[True, ordered[1:] != ordered[:-1], True])
    targets: list[int] = []
    payloads: list[bytes] = []
    for a, b in zip(bounds[:-1].tolist(), bounds[1:].tolist(), strict=True):
        for start in range(a, b, PACK_ROWS):
            part = wire.take(pa.array(order[start : min(start + PACK_ROWS, b)]))
            targets.append(int(ordered[a]))
            payloads.append(_stream(part).to_pybytes())
    n = len(targets)
    columns = {f.name: pa.nulls(n, f.type) for f in schema}
    columns |= {
        "kind": pa.repeat(pa.scalar(PACKED, pa.string()), n),
        "instance": pa.array(targets, pa.int32()),
        "payload": pa.array(payloads, pa.binary()),
    }
    return pa.RecordBatch.from_pydict(columns, schema=schema)


def packed_wire(rows: pa.RecordBatch, tags: Tags) -> pa.RecordBatch:
    """Stage 1's ``rows`` (on the wire) with its records and partials packed, its other
    rows (a copy of the ``stat`` rows per instance, dead letters, pending elements) as
    they are."""
    kinds = pa.array([tags.kind_code(RECORD).as_py(), tags.kind_code(PARTIAL).as_py()])
    mask = pc.is_in(rows.column("kind"), value_set=kinds.cast(rows.schema.field("kind").type))
    if not pc.any(mask).as_py():
        return rows
    packs = tags.to_wire(packed(rows.filter(mask), tags))
    return pa.concat_batches([rows.filter(pc.invert(mask)), packs.cast(rows.schema)])


@dataclasses.dataclass(frozen=True)
class Packing:
    """A stage-1 ``mapInArrow`` body (``body``: its wire rows out) whose records and
    partials leave packed (:func:`packed_wire`)."""

    body: Callable[[Iterable[pa.RecordBatch]], Iterator[pa.RecordBatch]]
    pipeline: Pipeline

    def __call__(self, batches: Iterable[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        tags = tags_of(self.pipeline)
        for rows in self.body(batches):
            yield packed_wire(rows, tags)


def unpacked(table: pa.Table, tags: Tags, where: str) -> pa.Table:
    """``table`` (an instance's wire rows) with its packed rows replaced by the rows
    they hold, on the same wire codes; other rows as they are."""
    is_packed = pc.equal(table.column("kind"), tags.kind_code(PACKED))
    if not pc.any(is_packed).as_py():
        return table
    rows = table.filter(is_packed)
    parts = [table.filter(pc.invert(is_packed))]
    expected = [(f.name, f.type) for f in table.schema]
    for payload in rows.column("payload").combine_chunks():
        with pa.ipc.open_stream(payload.as_buffer()) as reader:
            part = reader.read_all()
        if [(f.name, f.type) for f in part.schema] != expected:
            raise BatchError(
                f"{where}: a packed row holds rows of schema {part.schema}, not the "
                f"exchange's ({table.schema}); both ends of an exchange run the same "
                "microbatch, so report this as a bug"
            )
        parts.append(part.cast(table.schema))
    return pa.concat_tables(parts)


def _stream(rows: pa.RecordBatch | pa.Table) -> pa.Buffer:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, rows.schema) as writer:
        writer.write(rows)
    return sink.getvalue()
