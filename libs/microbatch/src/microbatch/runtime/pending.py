"""Enrichment inputs a batch left unfinished, carried to the next batch by the checkpoint.

Stage 1 turns an input not enriched by its task's deadline into a ``pending`` row; stage 2
hands those back to the driver (:attr:`InstanceResult.pending`), which writes them, in
source order, as one Arrow file of the checkpoint (:func:`save_pending`, named by the
batch record's ``enrich_pending``). The next batch re-issues them first
(:func:`load_pending`, as stage-1 input rows).
"""

from __future__ import annotations

import io
from collections.abc import Iterable

import pyarrow as pa
import pyarrow.ipc as ipc

from microbatch.checkpoint import Layout
from microbatch.runtime.records import InstanceResult, PendingRef
from microbatch.storage import ObjectStore


def load_pending(store: ObjectStore, ref: PendingRef | None) -> pa.Table | None:
    """The pending inputs of ``ref`` as stage-1 input rows (the Kafka source columns;
    ``value`` holds each pending element's bytes), None when there are none."""
    if ref is None:
        return None
    data = ipc.open_file(io.BytesIO(store.get(ref.file))).read_all()
    return pa.table(
        {
            "topic": data.column("topic"),
            "partition": data.column("partition"),
            "offset": data.column("offset"),
            "key": pa.nulls(data.num_rows, pa.binary()),
            "value": data.column("payload"),
        }
    )


def save_pending(
    store: ObjectStore,
    layout: Layout,
    batch_id: int,
    attempt: str,
    results: Iterable[InstanceResult],
) -> PendingRef | None:
    """Write the pending inputs every instance handed back, in source order, under this
    attempt's name (a stalled twin of the attempt never overwrites the committed one's)."""
    rows = sorted((p.topic, p.partition, p.offset, p.payload) for r in results for p in r.pending)
    if not rows:
        return None
    topics, parts, offsets, payloads = zip(*rows, strict=True)
    table = pa.table(
        {
            "topic": pa.array(topics, pa.string()),
            "partition": pa.array(parts, pa.int32()),
            "offset": pa.array(offsets, pa.int64()),
            "payload": pa.array(payloads, pa.binary()),
        }
    )
    buf = io.BytesIO()
    with ipc.new_file(buf, table.schema) as writer:
        writer.write_table(table)
    key = layout.pending_key(batch_id, attempt)
    store.put(key, buf.getvalue())
    return PendingRef(key, table.num_rows)
