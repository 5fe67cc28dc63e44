"""State files: one Arrow IPC file per operator instance per checkpoint.

Why Arrow IPC (the "Feather v2" file format): any Arrow reader opens it whole —
``pyarrow.ipc.open_file``, ``pyarrow.feather.read_table``, pandas ``read_feather``,
DuckDB, Polars — while each key-group is *one record batch* whose exact byte range we
record. A restore fetches only that range and decodes it with the fixed schema below
(``pyarrow.ipc.read_message`` + ``read_record_batch``), without the file header or footer.
Buffers are zstd-compressed inside the batch, so ranges stay independently readable.

Rows follow :data:`microbatch.state.backend.ROW_COLUMNS`, plus ``key_group`` so a whole
file read by a standard tool is self-describing.
"""

from __future__ import annotations

import dataclasses
import zlib

import pyarrow as pa
import pyarrow.ipc as ipc

from microbatch.errors import CheckpointError
from microbatch.state.backend import ROW_COLUMNS, Rows

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


def read_state_file(data: bytes) -> pa.Table:
    """A whole state file as one table (for inspection; restores never do this)."""
    return ipc.open_file(pa.py_buffer(data)).read_all()
