"""Format-1 checkpoints (one state file per instance, key-group byte ranges) as microbatch
wrote them before sorted runs: fixtures for the read and migration paths, which the
product still has, now that its writer is retired (issue #28).

The encoder and the writer are the product's former ``statefile.encode_state_file`` and
``writer.write_instance``/``checkpoint``, moved here unchanged in what they write; the
file schema is the reader's (:data:`microbatch.checkpoint.format1.SCHEMA`), so fixture and
reader cannot drift apart.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import zlib
from collections.abc import Mapping, Sequence
from typing import Any

import pyarrow as pa
import pyarrow.ipc as ipc

from microbatch.checkpoint import KeyGroupEntry, Layout, Manifest
from microbatch.checkpoint.format1 import SCHEMA
from microbatch.state.backend import ROW_COLUMNS, KeyedStateBackend, Rows
from microbatch.storage import ObjectStore

_OPTIONS = ipc.IpcWriteOptions(compression="zstd")
# The file starts with 8 magic/padding bytes and the schema message; batches follow.
_HEADER_LEN = 8 + len(SCHEMA.serialize())


@dataclasses.dataclass(frozen=True)
class Segment:
    """Where one key-group's batch sits in a state file, and what it holds."""

    offset: int
    length: int
    crc32: int
    rows: int
    keys: int


def encode_state_file(groups: dict[int, Rows]) -> tuple[bytes, dict[int, Segment]]:
    """Serialize key-groups (ascending) into one file; return it and each group's segment."""
    sink = pa.BufferOutputStream()
    writer = ipc.new_file(sink, SCHEMA, options=_OPTIONS)
    spans: dict[int, tuple[int, int, int, int]] = {}
    for kg in sorted(groups):
        rows = groups[kg]
        n = len(rows["key"])
        arrays = [pa.array([kg] * n, pa.int32())]
        arrays += [pa.array(rows[c], SCHEMA.field(c).type) for c in ROW_COLUMNS]
        start = sink.tell() if spans else _HEADER_LEN
        writer.write_batch(pa.record_batch(arrays, schema=SCHEMA))
        spans[kg] = (start, sink.tell() - start, n, len(set(rows["key"])))
    writer.close()
    data = sink.getvalue().to_pybytes()
    index = {
        kg: Segment(off, length, zlib.crc32(data[off : off + length]), n, keys)
        for kg, (off, length, n, keys) in spans.items()
    }
    if index:  # guard the header arithmetic: the first batch must parse where we say
        first = index[min(index)]
        ipc.read_message(pa.py_buffer(data[first.offset : first.offset + first.length]))
    return data, index


def write_instance(
    store: ObjectStore,
    layout: Layout,
    backend: KeyedStateBackend,
    checkpoint_id: int,
    index: int,
    base: Manifest | None,
) -> dict[int, KeyGroupEntry | None]:
    """One instance's state file: every key-group with state when there is no base,
    else only the changed (``dirty``) ones; unchanged key-groups keep the base's entry."""
    backend.prune_expired()
    to_write = [kg for kg in backend.key_groups if base is None or kg in backend.dirty]
    groups = {kg: backend.export_rows(kg) for kg in to_write}
    groups = {kg: rows for kg, rows in groups.items() if rows["key"]}
    entries: dict[int, KeyGroupEntry | None] = {}
    if groups:
        data, segments = encode_state_file(groups)
        file_key = layout.state_key(checkpoint_id, index)
        store.put(file_key, data)
        for kg, seg in segments.items():
            entries[kg] = KeyGroupEntry(
                file_key, seg.offset, seg.length, seg.crc32, seg.rows, seg.keys, checkpoint_id
            )
    for kg in backend.key_groups:
        if kg not in entries:
            carried = base is not None and kg not in backend.dirty
            entries[kg] = base.key_groups[kg] if carried and base is not None else None
    return entries


def write_checkpoint(
    store: ObjectStore,
    layout: Layout,
    backends: Sequence[KeyedStateBackend],
    checkpoint_id: int,
    *,
    base: Manifest | None = None,
    pipeline_fingerprint: str = "fp",
    metadata: Mapping[str, Any] | None = None,
) -> Manifest:
    """A committed format-1 checkpoint of instances ``0..len(backends)-1`` (incremental
    over ``base`` when given); the backends' changes are acknowledged."""
    maxp = backends[0].max_parallelism
    key_groups: list[KeyGroupEntry | None] = [None] * maxp
    for i, backend in enumerate(backends):
        for kg, entry in write_instance(store, layout, backend, checkpoint_id, i, base).items():
            key_groups[kg] = entry
        backend.dirty.clear()
        backend.dirty_keys = set()
    manifest = Manifest(
        checkpoint_id=checkpoint_id,
        pipeline_fingerprint=pipeline_fingerprint,
        max_parallelism=maxp,
        parallelism=len(backends),
        key_groups=tuple(key_groups),
        full_checkpoint_id=checkpoint_id if base is None else base.full_checkpoint_id,
        created_at=dt.datetime.now(dt.UTC).isoformat(timespec="milliseconds"),
        metadata=dict(metadata or {}),
    )
    assert manifest.format_version == 1
    store.create(layout.manifest_key(checkpoint_id), manifest.to_json())
    return manifest
