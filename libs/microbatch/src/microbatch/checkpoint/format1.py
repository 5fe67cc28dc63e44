"""Reading checkpoints of format 1 (one state file per instance), for the one-way migration.

Microbatch no longer writes this format; a pipeline upgraded from a version that did
restores such a checkpoint once (the first batch after the upgrade, a reshard, the
inspection tools) and writes sorted runs from then on.

A format-1 state file is an Arrow IPC file ("Feather v2") per operator instance per
checkpoint, each key-group *one record batch* whose byte range, row and key counts and
CRC-32 the manifest records (:class:`~microbatch.checkpoint.manifest.KeyGroupEntry`).
Buffers are zstd-compressed inside the batch, so each range decodes on its own with the
fixed schema below (``pyarrow.ipc.read_message`` + ``read_record_batch``), without the
file header or footer. Rows follow :data:`microbatch.state.backend.ROW_COLUMNS`, plus
``key_group``.

Instance ``i`` of ``P'`` reads only its key-groups' byte ranges: grouped by file, sorted by
offset, neighbours closer than ``max_gap`` bytes coalesced into one ranged GET
(``max_gap=0``: only exactly adjacent ranges). After a rescale from ``P`` to ``P'`` an
instance's key-groups were written contiguously by at most a few old instances, so this
is typically one GET per file it touches. Every range is checked against the manifest's
CRC-32 before it is decoded; a missing file, a short read or a mismatch is a
:class:`CheckpointError` naming the checkpoint, the file and the key-group.
"""

from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Iterable

import pyarrow as pa
import pyarrow.ipc as ipc

from microbatch.checkpoint.manifest import KeyGroupEntry, Manifest
from microbatch.errors import CheckpointError
from microbatch.state.backend import ROW_COLUMNS, KeyedStateBackend, Rows
from microbatch.storage import ObjectNotFoundError, ObjectStore

FORMAT_VERSION = 1
SCHEMA = pa.schema(
    [
        ("key_group", pa.int32()),
        ("state", pa.string()),
        ("kind", pa.string()),
        ("key", pa.binary()),
        ("field", pa.binary()),
        ("value", pa.binary()),
        ("expires_ms", pa.int64()),
        ("timer_ts", pa.int64()),
    ],
    metadata={"microbatch.state_file_version": str(FORMAT_VERSION)},
)


@dataclasses.dataclass(frozen=True)
class RangeRead:
    """One ranged GET: ``length`` bytes of ``file`` from ``offset``, covering ``groups``."""

    file: str
    offset: int
    length: int
    groups: tuple[tuple[int, KeyGroupEntry], ...]


def plan_reads(manifest: Manifest, key_groups: Iterable[int], max_gap: int = 0) -> list[RangeRead]:
    """The ranged GETs that fetch ``key_groups`` of ``manifest``, coalesced per file."""
    by_file: dict[str, list[tuple[int, KeyGroupEntry]]] = {}
    for kg in key_groups:
        entry = manifest.key_groups[kg]
        if entry is not None:
            by_file.setdefault(entry.file, []).append((kg, entry))
    reads = []
    for file, items in sorted(by_file.items()):
        items.sort(key=lambda item: item[1].offset)
        group = [items[0]]
        for item in items[1:]:
            last = group[-1][1]
            if item[1].offset - (last.offset + last.length) <= max_gap:
                group.append(item)
            else:
                reads.append(_read(file, group))
                group = [item]
        reads.append(_read(file, group))
    return reads


def _read(file: str, group: list[tuple[int, KeyGroupEntry]]) -> RangeRead:
    start = group[0][1].offset
    end = max(e.offset + e.length for _, e in group)
    return RangeRead(file, start, end - start, tuple(group))


def load_files(
    store: ObjectStore,
    manifest: Manifest,
    backend: KeyedStateBackend,
    key_groups: Iterable[int],
    max_gap: int = 0,
) -> tuple[int, int, int, int]:
    """Load ``key_groups`` of a format-1 ``manifest`` into ``backend``; returns (requests,
    bytes read, key-groups loaded, bytes of those key-groups)."""
    reads = plan_reads(manifest, key_groups, max_gap)
    nbytes = own = groups = 0
    for read in reads:
        data = _fetch(store, manifest, read)
        nbytes += len(data)
        for kg, entry in read.groups:
            where = (
                f"checkpoint {manifest.checkpoint_id}, file {store.url}/{entry.file}, "
                f"key-group {kg}"
            )
            start = entry.offset - read.offset
            rows: Rows = decode_segment(data[start : start + entry.length], entry.crc32, where)
            backend.import_rows(kg, rows)
            own += entry.length
            groups += 1
    return len(reads), nbytes, groups, own


def _fetch(store: ObjectStore, manifest: Manifest, read: RangeRead) -> bytes:
    kgs = ", ".join(str(kg) for kg, _ in read.groups)
    where = f"checkpoint {manifest.checkpoint_id}, file {store.url}/{read.file}, key-group(s) {kgs}"
    try:
        data = store.get_range(read.file, read.offset, read.length)
    except ObjectNotFoundError:
        raise CheckpointError(f"{where}: the state file is missing") from None
    if len(data) != read.length:
        raise CheckpointError(
            f"{where}: the state file is truncated (read {len(data)} of {read.length} bytes "
            f"at offset {read.offset})"
        )
    return data


def decode_segment(data: bytes, crc32: int, where: str) -> Rows:
    """Rows of one key-group's batch; ``where`` names checkpoint/file/key-group in errors."""
    if zlib.crc32(data) != crc32:
        raise CheckpointError(
            f"{where}: checksum mismatch ({len(data)} bytes, crc32 {zlib.crc32(data):#010x}, "
            f"manifest says {crc32:#010x}): the state file is corrupt or truncated"
        )
    try:
        message = ipc.read_message(pa.py_buffer(data))
        batch = ipc.read_record_batch(message, SCHEMA)
    except (pa.ArrowException, OSError) as e:
        raise CheckpointError(f"{where}: cannot decode the Arrow batch: {e}") from e
    return {c: batch.column(c).to_pylist() for c in ROW_COLUMNS}
