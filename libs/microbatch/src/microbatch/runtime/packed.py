"""A keyed step's records for the next step, packed: a few rows per next instance, each
holding thousands of envelope rows as one Arrow IPC stream.

Spark moves the rows of an exchange one by one: a ``mapInArrow`` body's output becomes
JVM rows, is shuffled, and becomes Arrow again for the next body. For a step that hands
on 600k rows a batch (Nexmark q5's counts per auction and window), that per-row work
cost more than the step itself. So a step's records go out as ``packed`` rows instead —
``instance``: the next instance they are all for, ``payload``: their envelope rows (on
the wire codes) as an IPC stream of at most :data:`PACK_ROWS` rows — and
:func:`unpacked` restores them where the next body receives its partition, before it
looks at a single row. Only the Arrow buffers are copied on either side.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from microbatch.errors import BatchError
from microbatch.runtime.envelope import ENVELOPE_SCHEMA, PACKED
from microbatch.runtime.wire import Tags

#: Envelope rows per packed row: ~3 MB of q5's rows, far below what Spark handles as
#: one value, and enough that the JVM's work per packed row does not count.
PACK_ROWS = 32_768


def packed(rows: pa.RecordBatch | pa.Table, tags: Tags) -> pa.RecordBatch:
    """``rows`` (envelope rows, plain) as packed rows, one or more per instance."""
    if not rows.num_rows:
        return pa.RecordBatch.from_pylist([], schema=ENVELOPE_SCHEMA)
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
    columns = {f.name: pa.nulls(n, f.type) for f in ENVELOPE_SCHEMA}
    columns |= {
        "kind": pa.repeat(pa.scalar(PACKED, pa.string()), n),
        "instance": pa.array(targets, pa.int32()),
        "payload": pa.array(payloads, pa.binary()),
    }
    return pa.RecordBatch.from_pydict(columns, schema=ENVELOPE_SCHEMA)


def unpacked(table: pa.Table, tags: Tags, where: str) -> pa.Table:
    """``table`` (an instance's wire rows) with its packed rows replaced by the rows
    they hold, on the same wire codes; other rows as they are."""
    is_packed = pc.equal(table.column("kind"), tags.kind_code(PACKED))
    if not pc.any(is_packed).as_py():
        return table
    rows = table.filter(is_packed)
    wire = tags.wire_schema(ENVELOPE_SCHEMA)
    parts = [table.filter(pc.invert(is_packed))]
    for payload in rows.column("payload").combine_chunks():
        with pa.ipc.open_stream(payload.as_buffer()) as reader:
            part = reader.read_all()
        if part.schema != wire:
            raise BatchError(
                f"{where}: a packed row holds rows of schema {part.schema}, not the "
                "envelope's; both ends of an exchange run the same microbatch, so report "
                "this as a bug"
            )
        parts.append(part)
    return pa.concat_tables(parts, promote_options="default")


def _stream(rows: pa.RecordBatch | pa.Table) -> pa.Buffer:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, rows.schema) as writer:
        writer.write(rows)
    return sink.getvalue()
