"""Sorted runs: immutable files of (key-group, key) → value, read a block at a time.

The state layer that scales past memory (issue #18) stores each change set as a *run*:
rows sorted by ``(key_group, key)``, cut into small blocks, each block one Arrow record
batch whose byte range the run's index records. Because rows are ordered by key-group
first, the key-groups an instance owns are one contiguous stretch of every run, and a
lookup of a batch's keys needs only the blocks that may hold them:

- **point reads**: binary search of the index's block boundaries per key; only those
  blocks' bytes are fetched (``ObjectStore.get_range``), so a batch touching 0.1 % of the
  keys reads a small fraction of the state when blocks hold ~100 rows;
- **rescaling**: :meth:`RunIndex.blocks_in_range` gives the blocks overlapping a key-group
  range — an instance reads its share of a run and clips the rest, as Flink's RocksDB
  restore does with SST files;
- **compaction**: :func:`merge` combines runs newest-first into one (the newest value of a
  key wins; deletions — rows whose value is null — are kept until the bottom run).

A run is two objects: the data, a valid Arrow IPC file any Arrow reader opens whole
(``pyarrow.ipc.open_file``, Polars, DuckDB), and its index, a small Arrow IPC file with
one row per block. Every block carries a CRC32 in the index: a corrupt or truncated range
is an error naming the run and block, never an empty state.

Sort keys are ``composite(kg, key) = kg as 2 bytes big-endian + key`` (key-groups fit in
15 bits), so byte order is (key-group, key) order.
"""

from __future__ import annotations

import bisect
import dataclasses
import heapq
import itertools
import zlib
from collections.abc import Iterable, Iterator, Sequence
from typing import NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.ipc as ipc

from microbatch.errors import CheckpointError

FORMAT_VERSION = 1
SCHEMA = pa.schema(
    [("key_group", pa.int32()), ("key", pa.binary()), ("value", pa.binary())],
    metadata={"microbatch.run_version": str(FORMAT_VERSION)},
)
INDEX_SCHEMA = pa.schema(
    [
        ("first", pa.binary()),
        ("last", pa.binary()),
        ("offset", pa.int64()),
        ("length", pa.int64()),
        ("crc32", pa.int64()),
        ("rows", pa.int32()),
    ],
    metadata={"microbatch.run_index_version": str(FORMAT_VERSION)},
)
#: Uncompressed bytes of keys and values per block: ~75 small entries, the granularity at
#: which a cold read fetches. A batch of random keys touches ``1 - (1 - f) ** rows`` of the
#: blocks for a fraction ``f`` of the keys: measured at 1M keys and f = 0.1 %, 4 KiB blocks
#: read 0.110 of the run (index included), 3 KiB 0.091 and 2 KiB 0.074, whose index (2.5 %
#: of the run, read whole) and block count grow in turn. 3 KiB keeps a 0.1 % batch under a
#: tenth of the state.
BLOCK_BYTES = 3072
#: LZ4 rather than zstd: a lookup decodes thousands of small blocks, and zstd's set-up per
#: buffer made decoding cost ~180 µs a block against ~35 µs (zstd files are ~40 % smaller).
#: One thread: a block's few small buffers compressed on Arrow's thread pool cost twice
#: the CPU of compressing them in place (100k entries: 0.29 s against 0.16).
_OPTIONS = ipc.IpcWriteOptions(compression="lz4", use_threads=False)
_HEADER_LEN = 8 + len(SCHEMA.serialize())  # magic + padding, then the schema message
#: A block is read as a one-batch stream behind this schema message, on one thread: 11 µs
#: a block against 52 µs with Arrow's pool decompressing its few small buffers.
_SCHEMA_MESSAGE = SCHEMA.serialize().to_pybytes()
_READ_OPTIONS = ipc.IpcReadOptions(use_threads=False)

#: One entry: its sort key and its value (None: the key's state was deleted).
Entry = tuple[bytes, "bytes | None"]


def composite(key_group: int, key: bytes) -> bytes:
    """The sort key of ``key`` in ``key_group``: byte order is (key-group, key) order."""
    return key_group.to_bytes(2, "big") + key


def split(sort_key: bytes) -> tuple[int, bytes]:
    return int.from_bytes(sort_key[:2], "big"), sort_key[2:]


class Block(NamedTuple):
    """Where one block sits in a run's data file and which sort keys it spans (a named
    tuple: a run's index holds tens of thousands, built at once when it is read)."""

    first: bytes
    last: bytes
    offset: int
    length: int
    crc32: int
    rows: int


@dataclasses.dataclass(frozen=True)
class RunIndex:
    """The blocks of one run, in key order."""

    blocks: tuple[Block, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "_firsts", [b.first for b in self.blocks])
        object.__setattr__(self, "_bounds", None)  # Arrow copies, made on first use

    @property
    def rows(self) -> int:
        return sum(b.rows for b in self.blocks)

    @property
    def data_bytes(self) -> int:
        return sum(b.length for b in self.blocks)

    @property
    def key_groups(self) -> tuple[int, int] | None:
        """The first and last key-group with rows, None for an empty run."""
        if not self.blocks:
            return None
        return split(self.blocks[0].first)[0], split(self.blocks[-1].last)[0]

    def block_of(self, sort_key: bytes) -> int | None:
        """The only block that may hold ``sort_key``, None if none can."""
        i = bisect.bisect_right(self._firsts, sort_key) - 1  # type: ignore[attr-defined]
        if i < 0 or sort_key > self.blocks[i].last:
            return None
        return i

    def blocks_of(self, sort_keys: pa.Array) -> np.ndarray:
        """:meth:`block_of` of every key of ``sort_keys`` (binary) at once, -1 where no
        block can hold it: a batch asks for 100k keys and more, and Arrow sorts the keys
        with the blocks' first keys instead of a binary search per key in Python."""
        n, m = len(sort_keys), len(self.blocks)
        if not n or not m:
            return np.full(n, -1, dtype=np.int64)
        firsts, lasts = self._first_and_last()
        both = pa.table(
            {
                "key": pa.concat_arrays([firsts, sort_keys.cast(pa.binary())]),
                "probe": np.r_[np.zeros(m, np.int8), np.ones(n, np.int8)],
            }
        )  # a block's first key sorts before an equal probe: that block may hold it
        order = pc.sort_indices(
            both, sort_keys=[("key", "ascending"), ("probe", "ascending")]
        ).to_numpy()
        firsts_so_far = np.cumsum(order < m)
        probes = np.flatnonzero(order >= m)
        at = np.empty(n, dtype=np.int64)
        at[order[probes] - m] = firsts_so_far[probes] - 1
        inside = at >= 0
        last = lasts.take(pa.array(np.where(inside, at, 0)))
        inside &= pc.less_equal(sort_keys, last).to_numpy(zero_copy_only=False)
        at[~inside] = -1
        return at

    def _first_and_last(self) -> tuple[pa.Array, pa.Array]:
        """Every block's first and last sort key, as binary arrays."""
        bounds = self._bounds  # type: ignore[has-type]
        if bounds is None:
            bounds = (
                pa.array(self._firsts, pa.binary()),  # type: ignore[attr-defined]
                pa.array([b.last for b in self.blocks], pa.binary()),
            )
            object.__setattr__(self, "_bounds", bounds)
        return bounds

    def blocks_in_range(self, kg_first: int, kg_last: int) -> range:
        """The blocks holding rows of key-groups ``kg_first..kg_last`` (inclusive)."""
        return self.blocks_between(composite(kg_first, b""), composite(kg_last + 1, b""))

    def blocks_between(self, lo: bytes, hi: bytes) -> range:
        """The blocks that may hold sort keys in ``[lo, hi)``."""
        start = max(bisect.bisect_right(self._firsts, lo) - 1, 0)  # type: ignore[attr-defined]
        while start < len(self.blocks) and self.blocks[start].last < lo:
            start += 1
        stop = bisect.bisect_left(self._firsts, hi)  # type: ignore[attr-defined]
        return range(start, max(start, stop))

    def to_bytes(self) -> bytes:
        columns = {f.name: [getattr(b, f.name) for b in self.blocks] for f in INDEX_SCHEMA}
        table = pa.table(columns, schema=INDEX_SCHEMA)
        sink = pa.BufferOutputStream()
        with ipc.new_file(sink, INDEX_SCHEMA, options=_OPTIONS) as writer:
            writer.write_table(table)
        return sink.getvalue().to_pybytes()

    @classmethod
    def from_bytes(cls, data: bytes, where: str) -> RunIndex:
        try:
            table = ipc.open_file(pa.py_buffer(data)).read_all()
            columns = [table.column(f.name).to_pylist() for f in INDEX_SCHEMA]
            return cls(tuple(map(Block._make, zip(*columns, strict=True))))
        except (pa.ArrowException, OSError, TypeError, KeyError) as e:
            raise CheckpointError(f"{where}: the run index cannot be read ({e})") from e


def encode_run(
    entries: Iterable[Entry],
    block_bytes: int = BLOCK_BYTES,
    plain: list[pa.RecordBatch] | None = None,
) -> tuple[bytes, RunIndex]:
    """A run's data file and index from ``entries`` in strictly ascending sort-key order;
    each block's batch also appended to ``plain`` if given (what the block decodes to).

    Entries are taken :data:`_CHUNK` at a time and each chunk is cut into blocks as Arrow
    columns (a merge's stream of millions of entries never sits in memory as Python
    objects at once; a batch's 100k keys cost a few array builds, not a Python loop)."""
    sink = pa.BufferOutputStream()
    writer = ipc.new_file(sink, SCHEMA, options=_OPTIONS)
    spans: list[tuple[bytes, bytes, int, int, int]] = []
    stream = iter(entries)
    keys: list[bytes] = []
    values: list[bytes | None] = []
    while True:
        chunk = list(itertools.islice(stream, _CHUNK))
        if chunk:
            more_keys, more_values = zip(*chunk, strict=True)
            keys += more_keys
            values += more_values
        if not keys:
            break
        last = spans[-1][1] if spans else None
        taken = _write_blocks(writer, sink, keys, values, last, block_bytes, spans, plain,
                              final=not chunk)  # fmt: skip
        del keys[:taken], values[:taken]
        if not chunk:
            break
    writer.close()
    data = sink.getvalue().to_pybytes()
    blocks = tuple(
        Block(first, last, off, length, zlib.crc32(data[off : off + length]), rows)
        for first, last, off, length, rows in spans
    )
    if blocks:  # guard the header arithmetic: the first block must parse where we say
        ipc.read_message(pa.py_buffer(data[blocks[0].offset : blocks[0].offset + blocks[0].length]))
    return data, RunIndex(blocks)


#: Entries cut into blocks at a time by :func:`encode_run`.
_CHUNK = 1 << 16


def _write_blocks(
    writer: ipc.RecordBatchFileWriter,
    sink: pa.BufferOutputStream,
    keys: list[bytes],
    values: list[bytes | None],
    previous: bytes | None,
    block_bytes: int,
    spans: list[tuple[bytes, bytes, int, int, int]],
    plain: list[pa.RecordBatch] | None,
    final: bool,
) -> int:
    """Write the blocks of ``keys``/``values`` (sort keys after ``previous``): each as
    many entries as reach ``block_bytes`` of keys and values, the last one short only
    when ``final``. Returns how many entries were written (the rest wait for more)."""
    sort_keys = pa.array(keys, pa.binary())
    _check_order(keys, sort_keys, previous)
    offsets = np.frombuffer(sort_keys.buffers()[1], np.int32, len(keys) + 1)
    lengths = np.diff(offsets)
    if lengths.min() < 2:
        raise ValueError(f"run entry sort key {keys[int(lengths.argmin())]!r} has no key-group")
    column = pa.array(values, pa.binary())
    value_lengths = pc.fill_null(pc.binary_length(column), 0).to_numpy(zero_copy_only=False)
    ends = np.cumsum(lengths + value_lengths, dtype=np.int64)
    cuts: list[int] = []
    done = 0  # bytes in the blocks cut so far
    while True:  # a block ends at the first entry that takes it to block_bytes
        end = int(np.searchsorted(ends, done + block_bytes)) + 1
        if end > len(keys):
            break
        cuts.append(end)
        done = int(ends[end - 1])
    if final and (not cuts or cuts[-1] < len(keys)):
        cuts.append(len(keys))
    if not cuts:
        return 0
    data = np.frombuffer(sort_keys.buffers()[2], np.uint8)
    firsts = offsets[:-1]
    key_groups = pa.array(data[firsts].astype(np.int32) << 8 | data[firsts + 1], pa.int32())
    keep = np.ones(len(data), dtype=bool)  # every key's bytes but its key-group's two
    keep[firsts] = keep[firsts + 1] = False
    rest = pa.Array.from_buffers(
        pa.binary(),
        len(keys),
        [None, pa.py_buffer(offsets - 2 * np.arange(len(offsets), dtype=np.int32)),
         pa.py_buffer(data[keep])],
    )  # fmt: skip
    start = 0
    for end in cuts:
        at = sink.tell() if spans else _HEADER_LEN
        n = end - start
        batch = pa.record_batch(
            [key_groups.slice(start, n), rest.slice(start, n), column.slice(start, n)],
            schema=SCHEMA,
        )
        writer.write_batch(batch)
        if plain is not None:
            plain.append(batch)
        spans.append((keys[start], keys[end - 1], at, sink.tell() - at, n))
        start = end
    return start


def _check_order(keys: list[bytes], sort_keys: pa.Array, previous: bytes | None) -> None:
    """Refuse sort keys that are not strictly ascending (after ``previous``)."""
    if previous is not None and keys[0] <= previous:
        raise ValueError(f"run entries out of order: {keys[0]!r} after {previous!r}")
    n = len(keys)
    if n > 1:
        bad = pc.less_equal(sort_keys.slice(1), sort_keys.slice(0, n - 1))
        if pc.any(bad).as_py():
            i = int(np.argmax(bad.to_numpy(zero_copy_only=False)))
            raise ValueError(f"run entries out of order: {keys[i + 1]!r} after {keys[i]!r}")


def decode_batch(data: bytes, block: Block, where: str) -> pa.RecordBatch:
    """One block as an Arrow batch (``key_group``, ``key``, ``value``), checked against its
    index entry; ``where`` names run and block in errors."""
    if len(data) != block.length or zlib.crc32(data) != block.crc32:
        raise CheckpointError(
            f"{where}: checksum mismatch ({len(data)} bytes, crc32 {zlib.crc32(data):#010x}; "
            f"the index says {block.length} bytes, {block.crc32:#010x}): the run is corrupt "
            "or truncated"
        )
    try:
        stream = ipc.open_stream(pa.py_buffer(_SCHEMA_MESSAGE + data), options=_READ_OPTIONS)
        return stream.read_next_batch()
    except (pa.ArrowException, OSError) as e:
        raise CheckpointError(f"{where}: cannot decode the block: {e}") from e


def decode_block(data: bytes, block: Block, where: str) -> list[Entry]:
    """The entries of one block, from its bytes."""
    batch = decode_batch(data, block, where)
    kgs = batch.column(0).to_pylist()
    keys = batch.column(1).to_pylist()
    values = batch.column(2).to_pylist()
    return [(composite(kg, k), v) for kg, k, v in zip(kgs, keys, values, strict=True)]


def read_run(data: bytes) -> pa.Table:
    """A whole run as one table (inspection and standard tools; lookups never do this)."""
    return ipc.open_file(pa.py_buffer(data)).read_all()


def merge(runs: Sequence[Iterable[Entry]], *, keep_deletions: bool) -> Iterator[Entry]:
    """The entries of ``runs`` (newest first, each in key order) as one ordered stream in
    which the newest entry of each key wins. ``keep_deletions=False`` (a merge into the
    bottom, with nothing older below) drops deleted keys altogether."""

    def aged(age: int, run: Iterable[Entry]) -> Iterator[tuple[bytes, int, bytes | None]]:
        for key, value in run:
            yield key, age, value  # equal keys order by age: the newest comes first

    streams = [aged(age, run) for age, run in enumerate(runs)]
    previous = None
    for key, _, value in heapq.merge(*streams):
        if key == previous:
            continue  # an older entry of a key already emitted
        previous = key
        if value is None and not keep_deletions:
            continue
        yield key, value


def clip(entries: Iterable[Entry], kg_first: int, kg_last: int) -> Iterator[Entry]:
    """The entries of key-groups ``kg_first..kg_last`` (a rescaled instance's share)."""
    lo, hi = composite(kg_first, b""), composite(kg_last + 1, b"")
    for key, value in entries:
        if key >= hi:
            return
        if key >= lo:
            yield key, value
