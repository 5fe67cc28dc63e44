"""Point reads across sorted runs, with the runs' blocks cached on local disk.

Runs are immutable (:mod:`microbatch.state.engine.runs`), so a block fetched once stays valid
forever: an executor keeps fetched blocks and indexes in a local folder between batches
(the same machine, a warm Spark Connect worker) and fetches from the object store — still
the truth — only what it lacks. A miss is one ranged GET per block, issued in parallel.

:func:`lookup` answers "the newest value of each of these keys" by asking each run,
newest first, only for the keys still unanswered, and only for the blocks that may hold
them (the run's index).
"""

from __future__ import annotations

import bisect
import dataclasses
import hashlib
import os
import uuid
import zlib
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.ipc as ipc

from microbatch.errors import CheckpointError, StorageError
from microbatch.state.engine.runs import SCHEMA, Entry, RunIndex, composite, decode_batch, merge
from microbatch.storage import ObjectStore

#: Ranged GETs in flight per lookup: enough to hide S3 latency on a cold cache.
FETCH_THREADS = 16


@dataclasses.dataclass(frozen=True)
class RunRef:
    """A run as a manifest names it: its two objects and the key-groups it serves here
    (after a rescale, one run may serve two instances, each its own clipped range)."""

    data: str
    index: str
    kg_first: int
    kg_last: int
    #: Size of the run's data object (the whole run, whatever range this ref serves).
    bytes: int = 0

    def clipped(self, kg_first: int, kg_last: int) -> RunRef | None:
        """This ref limited to key-groups ``kg_first..kg_last``; None if they do not meet."""
        first, last = max(self.kg_first, kg_first), min(self.kg_last, kg_last)
        if first > last:
            return None
        return dataclasses.replace(self, kg_first=first, kg_last=last)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, body: Mapping[str, Any]) -> RunRef:
        return cls(
            str(body["data"]),
            str(body["index"]),
            int(body["kg_first"]),
            int(body["kg_last"]),
            int(body.get("bytes", 0)),
        )


@dataclasses.dataclass
class CacheStats:
    """What a cache did: for benchmarks and the batch's stats."""

    requests: int = 0
    bytes_fetched: int = 0
    blocks_hit: int = 0
    blocks_fetched: int = 0
    blocks_decoded: int = 0

    def since(self, before: CacheStats) -> dict[str, int]:
        """What happened after ``before`` (a copy taken earlier), as the batch's stats."""
        return {
            "requests": self.requests - before.requests,
            "bytes": self.bytes_fetched - before.bytes_fetched,
            "blocks_hit": self.blocks_hit - before.blocks_hit,
            "blocks_fetched": self.blocks_fetched - before.blocks_fetched,
        }


#: Decoded blocks kept in memory per process (a reused Spark Python worker keeps them
#: between batches): the Arrow buffers plus the keys as Python bytes.
MEMORY_BYTES = 256 << 20
_KEY_OVERHEAD = 90  # a bytes object, its list slot and its place in ``_positions``, about
#: Missing blocks at most this far apart in a run are fetched with one ranged GET. Zero:
#: only blocks that touch (a scan's stretch, a merge's input) — a batch's point reads of
#: random keys would otherwise pull in the blocks between them, which measured 0.26 of
#: the state instead of 0.12 for 0.1 % of the keys.
COALESCE_GAP = 0
#: The most one coalesced GET reads.
COALESCE_MAX = 8 << 20
#: A run this process wrote is kept on local disk as one file of its blocks, decompressed
#: (a 4-byte count, count + 1 big-endian 8-byte offsets, then each block's CRC-32 and
#: body): one file per run instead of one per block — a 100k-key batch's 2,225 blocks took
#: 0.19 s of file writes. Blocks fetched from the store are kept one file each (``u<n>``).
_RUN_BLOCKS = "blocks"


class DecodedBlock:
    """One block in memory: its keys as a sorted Python list (binary search) and its values
    left in the Arrow array, so a lookup builds only the value it finds. A block within one
    key-group (almost all) keeps the keys without the key-group prefix."""

    __slots__ = ("_positions", "keys", "kg", "size", "values")

    def __init__(self, batch: pa.RecordBatch) -> None:
        kgs = batch.column(0)
        keys = batch.column(1).to_pylist()
        first, last = kgs[0].as_py(), kgs[len(kgs) - 1].as_py()
        #: The block's one key-group (keys are then without the prefix), else None.
        self.kg: int | None = first if first == last else None
        if self.kg is None:
            keys = [composite(kg, k) for kg, k in zip(kgs.to_pylist(), keys, strict=True)]
        self.keys = keys
        self.values = batch.column(2)
        self.size = batch.nbytes + _KEY_OVERHEAD * len(keys)
        self._positions: dict[bytes, int] | None = None  # key → position, made when asked

    def _position(self, sort_key: bytes) -> int:
        """Where ``sort_key`` is or would be in ``keys``."""
        if self.kg is None:
            return bisect.bisect_left(self.keys, sort_key)
        kg = int.from_bytes(sort_key[:2], "big")
        if kg != self.kg:
            return 0 if kg < self.kg else len(self.keys)
        return bisect.bisect_left(self.keys, sort_key[2:])

    def get_many(self, sort_keys: Sequence[bytes]) -> list[tuple[int, bytes | None]]:
        """(place in ``sort_keys``, value) of each of them this block holds (a deletion's
        value None): a dict probe per key, the block's values built at most once."""
        positions = self._positions
        if positions is None:
            positions = self._positions = dict(zip(self.keys, range(len(self.keys)), strict=True))
        if self.kg is None:
            probes: Sequence[bytes | None] = sort_keys
        else:
            prefix = self.kg.to_bytes(2, "big")
            probes = [k[2:] if k[:2] == prefix else None for k in sort_keys]
        hits = [(j, i) for j, i in enumerate(map(positions.get, probes)) if i is not None]
        if len(hits) <= 1:
            return [(j, self.values[i].as_py()) for j, i in hits]
        values = self.values.to_pylist()  # a block's ~75: cheaper than a take of a few
        return [(j, values[i]) for j, i in hits]

    def items(self, lo: bytes, hi: bytes) -> list[Entry]:
        """The entries with sort keys in ``[lo, hi)``, in order."""
        start, stop = self._position(lo), self._position(hi)
        if start >= stop:
            return []
        keys = self.keys[start:stop]
        if self.kg is not None:
            keys = [composite(self.kg, k) for k in keys]
        values = self.values.slice(start, stop - start).to_pylist()
        return list(zip(keys, values, strict=True))


class BlockCache:
    """Indexes and blocks of the runs in ``store``, in three tiers: decoded blocks in
    memory (at most ``memory_bytes``, least recently used go first), raw blocks in
    ``directory`` on local disk (None: none), and the store itself."""

    def __init__(
        self, store: ObjectStore, directory: Path | None = None, memory_bytes: int = MEMORY_BYTES
    ) -> None:
        self.store = store
        self.directory = directory
        self.memory_bytes = memory_bytes
        self.stats = CacheStats()
        #: Bytes this cache has written to its folder (the process-wide cache trims it).
        self.disk_bytes = 0
        self._indexes: dict[str, RunIndex] = {}
        self._decoded: OrderedDict[tuple[str, int], DecodedBlock] = OrderedDict()
        self._decoded_size = 0
        self._dirs: dict[str, str] = {}
        if directory is not None:
            try:
                directory.mkdir(parents=True, exist_ok=True)
                probe = directory / f".probe-{uuid.uuid4().hex}"
                probe.write_bytes(b"")
                probe.unlink()
            except OSError as e:
                raise StorageError(
                    f"the state cache folder {directory} is not writable ({e}); point the "
                    "cache at a writable local folder or disable it"
                ) from e

    def index(self, ref: RunRef) -> RunIndex:
        found = self._indexes.get(ref.index)
        if found is None:
            data = self._cached(ref.index, "index")
            if data is None:
                data = self._fetch(ref.index, None)
                self._keep(ref.index, "index", data)
            found = self._indexes[ref.index] = RunIndex.from_bytes(data, f"run {ref.data}")
        return found

    def entries(self, ref: RunRef, numbers: Iterable[int]) -> dict[int, DecodedBlock]:
        """Blocks ``numbers`` of run ``ref``, decoded (memory, else disk, else the store)."""
        out: dict[int, DecodedBlock] = {}
        raw_needed = []
        for n in numbers:
            hit = self._decoded.get((ref.data, n))
            if hit is None:
                raw_needed.append(n)
            else:
                self._decoded.move_to_end((ref.data, n))
                out[n] = hit
        if raw_needed:
            for n, batch in self.batches(ref, raw_needed).items():
                decoded = DecodedBlock(batch)
                self._remember((ref.data, n), decoded)
                self.stats.blocks_decoded += 1
                out[n] = decoded
        return out

    def batches(
        self, ref: RunRef, numbers: Iterable[int], keep: bool = True
    ) -> dict[int, pa.RecordBatch]:
        """Blocks ``numbers`` of run ``ref`` as Arrow batches, from local disk, else the
        store. On local disk a block is kept decompressed, with its own CRC-32 (decoding an
        LZ4 block costs ~55 µs, an uncompressed one ~4 µs): a block from the store is
        checked against the run's index, decompressed once, and written back in that form
        (``keep=False``: not written, e.g. a merge's inputs)."""
        out: dict[int, pa.RecordBatch] = {}
        fetch = []
        wanted = list(numbers)
        kept = self._kept_blocks(ref, wanted)
        for n in wanted:
            plain = kept.get(n)
            if plain is None:
                plain = self._cached(ref.data, f"u{n}")
            if plain is None:
                fetch.append(n)
                continue
            self.stats.blocks_hit += 1
            out[n] = self._decode_plain(ref, n, plain)
        if fetch:
            index = self.index(ref)
            for n, data in self.blocks(ref, fetch).items():
                batch = decode_batch(
                    data, index.blocks[n], f"run {self.store.url}/{ref.data} block {n}"
                )
                if keep:
                    self._keep_plain(ref, n, batch)
                out[n] = batch
        return out

    def _keep_plain(self, ref: RunRef, n: int, batch: pa.RecordBatch) -> None:
        if self.directory is not None:
            self._keep(ref.data, f"u{n}", _plain(batch))

    def _decode_plain(self, ref: RunRef, n: int, plain: bytes) -> pa.RecordBatch:
        where = f"the state cache's copy of run {ref.data} block {n} in {self.directory}"
        body = memoryview(plain)[4:]
        if len(plain) < 4 or zlib.crc32(body) != int.from_bytes(plain[:4], "big"):
            raise CheckpointError(
                f"{where} is corrupt (checksum mismatch): delete the cache folder; the "
                "store still has the run"
            )
        try:
            return ipc.read_record_batch(pa.py_buffer(body), SCHEMA)
        except (pa.ArrowException, OSError) as e:
            raise CheckpointError(f"{where} cannot be decoded ({e}): delete the folder") from e

    def _remember(self, slot: tuple[str, int], decoded: DecodedBlock) -> None:
        self._decoded[slot] = decoded
        self._decoded_size += decoded.size
        while self._decoded_size > self.memory_bytes and len(self._decoded) > 1:
            _, dropped = self._decoded.popitem(last=False)
            self._decoded_size -= dropped.size

    def keep_run(
        self, ref: RunRef, data: bytes, index: bytes, plain: list[pa.RecordBatch] | None = None
    ) -> None:
        """Put a run this process just wrote into the disk cache (its index and blocks),
        so the next batch on this machine does not fetch back what it uploaded.
        ``plain``: the blocks' batches as ``encode_run`` gave them, else decoded here."""
        if self.directory is None:
            return
        parsed = RunIndex.from_bytes(index, f"run {ref.data}")
        self._keep(ref.index, "index", index)
        self._indexes[ref.index] = parsed
        if plain is not None and len(plain) != len(parsed.blocks):
            plain = None  # not this run's blocks: decode them instead
        bodies = []
        for n, b in enumerate(parsed.blocks):
            if plain is not None:
                batch = plain[n]
            else:
                where = f"run {ref.data} block {n}"
                batch = decode_batch(data[b.offset : b.offset + b.length], b, where)
            bodies.append(_plain(batch))
        ends = np.cumsum([len(b) for b in bodies], dtype=np.uint64)
        offsets = np.concatenate([np.zeros(1, np.uint64), ends]).astype(">u8")
        head = len(bodies).to_bytes(4, "big") + offsets.tobytes()
        self._keep(ref.data, _RUN_BLOCKS, head + b"".join(bodies))

    def _kept_blocks(self, ref: RunRef, numbers: Sequence[int]) -> dict[int, bytes]:
        """Blocks ``numbers`` of run ``ref`` from its file of blocks, if a process on this
        machine wrote the run (:meth:`keep_run`); ``{}`` otherwise."""
        if self.directory is None or not numbers:
            return {}
        path = os.path.join(self._dir(ref.data), _RUN_BLOCKS)
        try:
            with open(path, "rb") as f:
                count = int.from_bytes(f.read(4), "big")
                base = 4 + 8 * (count + 1)
                size = os.fstat(f.fileno()).st_size
                offsets = np.frombuffer(f.read(8 * (count + 1)) if base <= size else b"", ">u8")
                if len(offsets) != count + 1 or max(numbers) >= count:
                    raise CheckpointError(
                        f"the state cache's copy of run {ref.data} in {path} is corrupt (its "
                        f"header names {count} blocks): delete the cache folder; the store "
                        "still has the run"
                    )
                out = {}
                for n in numbers:
                    f.seek(base + int(offsets[n]))
                    out[n] = f.read(int(offsets[n + 1] - offsets[n]))
                return out
        except FileNotFoundError:
            return {}

    def blocks(self, ref: RunRef, numbers: Iterable[int]) -> dict[int, bytes]:
        """The stored bytes of blocks ``numbers`` of run ``ref``, fetched from the store
        (neighbours with one ranged GET each, in parallel); not cached."""
        index = self.index(ref)
        out: dict[int, bytes] = {}
        missing = sorted(set(numbers))
        if missing:
            spans = coalesce(index, missing)

            def fetch(span: list[int]) -> list[tuple[int, bytes]]:
                first, last = index.blocks[span[0]], index.blocks[span[-1]]
                start = first.offset
                data = self._fetch(ref.data, (start, last.offset + last.length - start))
                return [
                    (n, data[index.blocks[n].offset - start :][: index.blocks[n].length])
                    for n in span
                ]

            with ThreadPoolExecutor(min(FETCH_THREADS, len(spans))) as pool:
                for fetched in pool.map(fetch, spans):
                    for n, data in fetched:
                        out[n] = data
                        self.stats.blocks_fetched += 1
        return out

    def _fetch(self, key: str, span: tuple[int, int] | None) -> bytes:
        try:
            data = self.store.get(key) if span is None else self.store.get_range(key, *span)
        except StorageError as e:
            raise CheckpointError(
                f"state run {self.store.url}/{key} cannot be read ({e}): a checkpoint names "
                "it, so it must exist; restore an older checkpoint if it was deleted"
            ) from e
        self.stats.requests += 1
        self.stats.bytes_fetched += len(data)
        return data

    def _dir(self, key: str) -> str:
        found = self._dirs.get(key)
        if found is None:
            digest = hashlib.sha256(f"{self.store.url}/{key}".encode()).hexdigest()[:32]
            found = self._dirs[key] = os.path.join(str(self.directory), digest[:2], digest)
        return found

    def _cached(self, key: str, part: str) -> bytes | None:
        if self.directory is None:
            return None
        try:
            with open(os.path.join(self._dir(key), part), "rb") as f:
                return f.read()
        except FileNotFoundError:
            return None

    def _keep(self, key: str, part: str, data: bytes) -> None:
        if self.directory is None:
            return
        folder = self._dir(key)
        path = os.path.join(folder, part)
        try:
            os.makedirs(folder, exist_ok=True)
            tmp = os.path.join(folder, f".{part}-{uuid.uuid4().hex}")
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, path)  # concurrent tasks write the same bytes: either wins
            self.disk_bytes += len(data)
        except OSError as e:
            raise StorageError(
                f"cannot write the state cache at {path} ({e}): free space in "
                f"{self.directory} or point the cache elsewhere"
            ) from e


def _plain(batch: pa.RecordBatch) -> bytes:
    """A block as the disk tier keeps it: its CRC-32, then the uncompressed batch."""
    body = batch.serialize().to_pybytes()
    return zlib.crc32(body).to_bytes(4, "big") + body


def coalesce(index: RunIndex, numbers: Iterable[int]) -> list[list[int]]:
    """Block numbers grouped into runs of blocks fetched by one ranged GET each: blocks
    at most :data:`COALESCE_GAP` bytes apart, at most :data:`COALESCE_MAX` bytes a GET."""
    spans: list[list[int]] = []
    for n in sorted(set(numbers)):
        block = index.blocks[n]
        if spans:
            head, tail = index.blocks[spans[-1][0]], index.blocks[spans[-1][-1]]
            gap = block.offset - (tail.offset + tail.length)
            if gap <= COALESCE_GAP and block.offset + block.length - head.offset <= COALESCE_MAX:
                spans[-1].append(n)
                continue
        spans.append([n])
    return spans


def lookup(
    cache: BlockCache, runs: Sequence[RunRef], sort_keys: Iterable[bytes]
) -> dict[bytes, bytes | None]:
    """The newest entry of each of ``sort_keys`` found in ``runs`` (newest first); a key
    whose newest entry is a deletion maps to None, a key in no run is absent."""
    keys = list(dict.fromkeys(sort_keys))
    found: dict[bytes, bytes | None] = {}
    if not keys or not runs:
        return found
    column = pa.array(keys, pa.binary())
    open_ = np.ones(len(keys), dtype=bool)  # not found in a newer run yet
    for ref in runs:
        lo, hi = composite(ref.kg_first, b""), composite(ref.kg_last + 1, b"")
        served = pc.and_(pc.greater_equal(column, lo), pc.less(column, hi))  # its part
        rows = np.flatnonzero(open_ & served.to_numpy(zero_copy_only=False))
        if not len(rows):
            continue
        at = cache.index(ref).blocks_of(column.take(pa.array(rows)))
        rows, at = rows[at >= 0], at[at >= 0]
        if not len(rows):
            continue
        order = np.argsort(at, kind="stable")
        rows, at = rows[order], at[order]
        starts = np.flatnonzero(np.r_[True, at[1:] != at[:-1]])
        stops = np.r_[starts[1:], len(at)].tolist()
        numbers = at[starts].tolist()
        decoded = cache.entries(ref, numbers)
        for n, start, stop in zip(numbers, starts.tolist(), stops, strict=True):
            mine = rows[start:stop].tolist()
            for j, value in decoded[n].get_many([keys[r] for r in mine]):
                found[keys[mine[j]]] = value
                open_[mine[j]] = False
        if not open_.any():
            break
    return found


def scan(cache: BlockCache, runs: Sequence[RunRef], lo: bytes, hi: bytes) -> list[Entry]:
    """Every live entry with a sort key in ``[lo, hi)`` across ``runs`` (newest first):
    the newest entry of each key, deletions left out. Reads only the blocks that overlap
    the range (due timers of a key-group, one instance's share after a rescale)."""
    per_run: list[list[Entry]] = []
    for ref in runs:
        lo_ref = max(lo, composite(ref.kg_first, b""))
        hi_ref = min(hi, composite(ref.kg_last + 1, b""))
        if lo_ref >= hi_ref:
            continue
        numbers = cache.index(ref).blocks_between(lo_ref, hi_ref)
        decoded = cache.entries(ref, numbers)
        per_run.append([e for n in numbers for e in decoded[n].items(lo_ref, hi_ref)])
    return list(merge(per_run, keep_deletions=False))
