"""Spike for issue #18 (keyed state past memory): which engine should hold keyed state?

Today every batch restores an instance's whole state into Python dicts and rewrites it, so
a batch costs the total state. The target layer makes a batch cost what it touches. This
script measures three candidate engines on the same data, in one run, against a SeaweedFS
it starts on free loopback ports (``--local``: a temporary folder). The spike also measured
"today's layer" (format 1: whole state files per instance); that layer's writer is retired,
so its phases are gone and its numbers in docs/state.md are history:

- ``rocksdict`` (RocksDB): SSTs built with ``SstFileWriter`` + ingest; checkpoints à la
  Flink (upload the SSTs a RocksDB checkpoint has that S3 lacks, plus MANIFEST/OPTIONS);
  a cold restore must download every file before the first read;
- ``slatedb`` (an LSM that lives on object storage): opened on the same S3 through a
  counting HTTP proxy (slatedb exposes no byte counters), cold reads in a fresh process;
- ``arrow-runs``: a prototype here, pyarrow + numpy only: immutable sorted runs (Arrow IPC
  files, one record batch per block) + a block index + a bloom filter per run; a point
  read fetches only the needed blocks by ranged GET; size-tiered compaction.

Keys are ``user-<n>``; the engine key is the 2-byte big-endian key-group + the canonical
key bytes, so an instance's key-groups are one contiguous key range. Values are a small
dict encoded with :func:`microbatch.state.codec.encode_value`. Each phase runs in its own
process so cold reads are really cold and the peak RSS is the phase's own.

    .venv/bin/python bench/spike_state_engines.py [--keys 2000000] [--local]
        [--only arrow-runs,rocksdict,slatedb] [--blocks 65536,4096,1536]
        [--rounds 8] [--max-gap 4096]

The runs recorded in docs/state.md: the default; ``--keys 10000000 --only
today,arrow-runs,rocksdict --blocks 1536,4096 --timeout 900``; and ``--only
arrow-runs,rocksdict,slatedb --blocks 1536 --rounds 40`` (long-run compaction).

``rocksdict`` and ``slatedb`` are not project dependencies; install them by hand for the
spike: ``.venv/bin/uv pip install --python .venv/bin/python rocksdict==0.3.29
slatedb==0.17.0``.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import concurrent.futures
import contextlib
import http.client
import http.server
import json
import os
import random
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mmh3
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.ipc as ipc
from benchlib import print_table

from microbatch.keygroups import key_group_range
from microbatch.state.codec import encode_value
from microbatch.storage import LocalFileStore, ObjectStore, S3Store
from microbatch.storage.counting import CountingStore

REPO = Path(__file__).resolve().parents[1]
MAXP = 128
BATCH = 10_000  # records of one batch: the keys read, and the entries changed
TIER = 4  # size-tiered compaction: merge TIER runs of one tier into one of the next
RESCALE = (3, 1)  # restore instance 1 of P'=3 (its key-groups were written by both of P=2)


# --- data -------------------------------------------------------------------------------
def db_key(n: int) -> bytes:
    """Key-group prefix + canonical key bytes: an instance's key-groups are one key range."""
    kb = b"suser-%d" % n
    return (mmh3.hash(kb, 0, signed=False) % MAXP).to_bytes(2, "big") + kb


def base_value(n: int) -> bytes:
    return encode_value({"count": n % 1000, "last": n * 7})


def all_entries(n_keys: int) -> tuple[list[bytes], list[bytes]]:
    """Every key and value of the base state, in engine-key order."""
    pairs = sorted((db_key(n), n) for n in range(n_keys))
    return [k for k, _ in pairs], [base_value(n) for _, n in pairs]


def changes(n_keys: int, rnd: int) -> list[tuple[bytes, bytes]]:
    """The entries one batch (round ``rnd``) changes: BATCH random existing keys."""
    ns = random.Random(1000 + rnd).sample(range(n_keys), min(BATCH, n_keys))
    return sorted((db_key(n), encode_value({"count": -rnd, "last": n})) for n in ns)


def expected(n_keys: int, ns: Sequence[int], rounds: int) -> dict[bytes, bytes]:
    """What reading keys ``ns`` must return after ``rounds`` incremental rounds."""
    want = {db_key(n): base_value(n) for n in ns}
    for rnd in range(1, rounds + 1):
        for k, v in changes(n_keys, rnd):
            if k in want:
                want[k] = v
    return want


def read_sample(n_keys: int, count: int, seed: int) -> list[int]:
    return random.Random(seed).sample(range(n_keys), min(count, n_keys))


def kg_bounds(parallelism: int, index: int) -> tuple[bytes, bytes]:
    """``[lo, hi)`` engine-key bounds of an instance's key-groups."""
    r = key_group_range(MAXP, parallelism, index)
    return r.start.to_bytes(2, "big"), (r.end + 1).to_bytes(2, "big")


def share_fraction(n_keys: int, parallelism: int, index: int) -> float:
    """Fraction of all keys in the instance's key-groups (exact, from the key hashes)."""
    r = key_group_range(MAXP, parallelism, index)
    kgs = np.fromiter(
        (mmh3.hash(b"suser-%d" % n, 0, signed=False) % MAXP for n in range(n_keys)), np.int32
    )
    return float(((kgs >= r.start) & (kgs <= r.end)).mean())


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# --- storage ----------------------------------------------------------------------------
def open_store(args: argparse.Namespace, prefix: str) -> CountingStore:
    if args.local:
        inner: ObjectStore = LocalFileStore(Path(args.work) / "store" / prefix)
    else:
        from microbatch.settings import Settings

        settings = Settings.from_env(s3_endpoint_url=args.endpoint, home=str(REPO / ".local"))
        inner = S3Store(settings.s3_bucket, f"spike/{prefix}", settings)
    return CountingStore(inner)


def fetch_ranges(
    store: ObjectStore, reads: Sequence[tuple[str, int, int]], threads: int = 8
) -> list[bytes]:
    """Ranged GETs in parallel (S3 latency, not bandwidth, dominates small reads)."""
    if len(reads) <= 1:
        return [store.get_range(*r) for r in reads]
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        return list(pool.map(lambda r: store.get_range(*r), reads))


# --- arrow-runs: the prototype ----------------------------------------------------------
RUN_SCHEMA = pa.schema([("key", pa.binary()), ("value", pa.binary())])
INDEX_SCHEMA = pa.schema(
    [("first", pa.binary()), ("last", pa.binary()), ("offset", pa.int64()), ("length", pa.int64())]
)
_IPC = ipc.IpcWriteOptions(compression="zstd")
_HEADER = 8 + len(RUN_SCHEMA.serialize())  # magic + schema message precede the first batch
BLOOM_BITS_PER_KEY = 10
BLOOM_HASHES = 7


def bloom_positions(keys: Sequence[bytes], m: int) -> np.ndarray:
    """(len(keys), k) bit positions by double hashing of one 128-bit murmur3 per key."""
    h = np.array([mmh3.hash64(k, 7, signed=False) for k in keys], dtype=np.uint64).reshape(-1, 2)
    i = np.arange(BLOOM_HASHES, dtype=np.uint64)
    return (h[:, :1] + i * h[:, 1:2]) % np.uint64(m)


def build_bloom(keys: Sequence[bytes]) -> bytes:
    m = max(64, len(keys) * BLOOM_BITS_PER_KEY // 8 * 8)  # whole bytes: packbits pads
    bits = np.zeros(m, dtype=bool)
    bits[bloom_positions(keys, m).ravel()] = True
    return np.packbits(bits).tobytes()


def bloom_may_contain(bloom: np.ndarray, keys: Sequence[bytes]) -> np.ndarray:
    m = bloom.size
    return bloom[bloom_positions(keys, m)].all(axis=1)


@dataclass
class RunMeta:
    """What the manifest would reference: one immutable run and its sizes."""

    name: str
    rows: int
    data_bytes: int
    index_bytes: int
    bloom_bytes: int
    tier: int = 0

    @property
    def total(self) -> int:
        return self.data_bytes + self.index_bytes + self.bloom_bytes


def write_run(
    store: ObjectStore, name: str, keys: Sequence[bytes], values: Sequence[bytes], block: int
) -> RunMeta:
    """One immutable run: data (an Arrow IPC file, a batch per block), index, bloom."""
    n = len(keys)
    avg = (sum(map(len, keys[:1000])) + sum(map(len, values[:1000]))) / max(1, min(n, 1000))
    per_block = max(8, int(block / max(1.0, avg / 2.5)))  # ~2.5x zstd on these rows
    sink = pa.BufferOutputStream()
    writer = ipc.new_file(sink, RUN_SCHEMA, options=_IPC)
    index: dict[str, list[Any]] = {"first": [], "last": [], "offset": [], "length": []}
    for s in range(0, n, per_block):
        start = sink.tell() if index["offset"] else _HEADER
        kk, vv = keys[s : s + per_block], values[s : s + per_block]
        writer.write_batch(
            pa.record_batch([pa.array(kk, pa.binary()), pa.array(vv, pa.binary())], RUN_SCHEMA)
        )
        for col, v in zip(index, (kk[0], kk[-1], start, sink.tell() - start), strict=True):
            index[col].append(v)
    writer.close()
    data = sink.getvalue().to_pybytes()
    idx_sink = pa.BufferOutputStream()
    with ipc.new_file(idx_sink, INDEX_SCHEMA, options=_IPC) as w:
        w.write_table(pa.table(index, INDEX_SCHEMA))
    idx = idx_sink.getvalue().to_pybytes()
    bloom = build_bloom(keys)
    store.put(f"{name}.arrow", data)
    store.put(f"{name}.idx", idx)
    store.put(f"{name}.bloom", bloom)
    return RunMeta(name, n, len(data), len(idx), len(bloom))


@dataclass
class OpenRun:
    """A run's index and bloom in memory (its data stays on S3 / in the cache)."""

    meta: RunMeta
    first: list[bytes]
    last: list[bytes]
    offset: list[int]
    length: list[int]
    bloom: np.ndarray | None


class RunsReader:
    """Point reads over runs (newest first); a sparse local copy of each run is the cache.

    The bottom (largest) run's bloom filter is not loaded: most batch keys exist and
    end there anyway, and at ~1.25 bytes/key it would cost ~10% of the state on a cold
    read — the budget of the whole batch.
    """

    def __init__(
        self, store: ObjectStore, runs: Sequence[RunMeta], cache: Path, max_gap: int
    ) -> None:
        self.store, self.cache, self.max_gap = store, cache, max_gap
        cache.mkdir(parents=True, exist_ok=True)
        self.runs: list[OpenRun] = []
        for pos, meta in enumerate(runs):
            idx = ipc.open_file(pa.py_buffer(self._object(f"{meta.name}.idx"))).read_all()
            bloom = None
            if pos < len(runs) - 1:
                raw = self._object(f"{meta.name}.bloom")
                bloom = np.unpackbits(np.frombuffer(raw, np.uint8)).astype(bool)
            cols = [idx.column(c).to_pylist() for c in INDEX_SCHEMA.names]
            self.runs.append(OpenRun(meta, *cols, bloom))
        self.requests = 0
        self.present: dict[str, set[int]] = {}  # blocks in the local sparse copies

    def _object(self, name: str) -> bytes:
        path = self.cache / name
        if path.exists():
            return path.read_bytes()
        data = self.store.get(name)
        path.write_bytes(data)
        return data

    def get_many(self, keys: Sequence[bytes]) -> dict[bytes, bytes]:
        """Values of ``keys`` (sorted); absent keys are left out."""
        found: dict[bytes, bytes] = {}
        todo = list(keys)
        for run in self.runs:
            if not todo:
                break
            cands = todo
            if run.bloom is not None:
                mask = bloom_may_contain(run.bloom, todo)
                cands = [k for k, ok in zip(todo, mask, strict=True) if ok]
            blocks: set[int] = set()
            for k in cands:
                b = bisect.bisect_right(run.first, k) - 1
                if b >= 0 and k <= run.last[b]:
                    blocks.add(b)
            if not blocks:
                continue
            batches = [
                ipc.read_record_batch(ipc.read_message(pa.py_buffer(data)), RUN_SCHEMA)
                for data in self._blocks(run, sorted(blocks))
            ]
            # One C++ scan of the decoded blocks against a hash set of the few candidates.
            table = pa.Table.from_batches(batches, RUN_SCHEMA)
            hits = table.filter(pc.is_in(table.column(0), value_set=pa.array(cands, pa.binary())))
            found.update(zip(hits.column(0).to_pylist(), hits.column(1).to_pylist(), strict=True))
            todo = [k for k in todo if k not in found]
        return found

    def _blocks(self, run: OpenRun, blocks: list[int]) -> list[bytes]:
        """The blocks' bytes, from the run's sparse local copy; missing ones are fetched by
        coalesced ranged GETs and written at their offset (a sparse file per run)."""
        path = self.cache / f"{run.meta.name}.arrow"
        have = self.present.setdefault(run.meta.name, set())
        missing = [b for b in blocks if b not in have]
        groups: list[list[int]] = []
        for b in missing:
            prev = groups[-1][-1] if groups else -1
            if groups and run.offset[b] - (run.offset[prev] + run.length[prev]) <= self.max_gap:
                groups[-1].append(b)
            else:
                groups.append([b])
        reads = [
            (
                f"{run.meta.name}.arrow",
                run.offset[g[0]],
                run.offset[g[-1]] + run.length[g[-1]] - run.offset[g[0]],
            )
            for g in groups
        ]
        self.requests += len(reads)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            for g, data in zip(groups, fetch_ranges(self.store, reads), strict=True):
                os.pwrite(fd, data, run.offset[g[0]])
                have.update(g)
            return [os.pread(fd, run.length[b], run.offset[b]) for b in blocks]
        finally:
            os.close(fd)


def merge_runs(store: ObjectStore, runs: Sequence[RunMeta], name: str, block: int) -> RunMeta:
    """Size-tiered compaction: newest value per key wins; ``runs`` newest first."""
    tables = []
    for seq, meta in enumerate(runs):
        t = ipc.open_file(pa.py_buffer(store.get(f"{meta.name}.arrow"))).read_all()
        tables.append(t.append_column("seq", pa.array(np.full(t.num_rows, seq, np.int32))))
    t = pa.concat_tables(tables).sort_by([("key", "ascending"), ("seq", "ascending")])
    keys = t.column("key").combine_chunks()
    keep = np.ones(len(keys), bool)
    if len(keys) > 1:
        same = pc.equal(keys.slice(1), keys.slice(0, len(keys) - 1)).to_numpy(zero_copy_only=False)
        keep[1:] = ~same
    t = t.filter(pa.array(keep))
    meta = write_run(store, name, t.column("key").to_pylist(), t.column("value").to_pylist(), block)
    meta.tier = max(m.tier for m in runs) + 1
    return meta


def arrow_build(args: argparse.Namespace) -> dict[str, Any]:
    """Base run, ``--rounds`` incremental runs with size-tiered compaction, rescale clip bytes."""
    res: dict[str, Any] = {}
    t = time.monotonic()
    keys, values = all_entries(args.keys)
    res["gen_s"] = time.monotonic() - t
    for block in args.blocks:
        store = open_store(args, f"arrow-{block}")
        t = time.monotonic()
        base = write_run(store, "base", keys, values, block)
        res[f"build_s_{block}"] = time.monotonic() - t
        small = open_store(args, f"arrow-small-{block}")
        sk, sv = zip(*sorted((db_key(n), base_value(n)) for n in range(BATCH)), strict=True)
        small_meta = write_run(small, "base", sk, sv, block)
        runs = [base]  # newest last while building
        store.reset()
        changed_bytes = 0
        for rnd in range(1, args.rounds + 1):
            ch = changes(args.keys, rnd)
            changed_bytes += sum(len(k) + len(v) for k, v in ch)
            new = write_run(store, f"r{rnd:04d}", [k for k, _ in ch], [v for _, v in ch], block)
            runs.append(new)
            for level in range(8):  # cascade: a merge may complete the next tier
                tier = [r for r in runs[1:] if r.tier == level]
                if len(tier) < TIER:
                    break
                merged = merge_runs(store, tier[::-1], f"c{rnd:04d}-{level}", block)
                runs = [r for r in runs if r not in tier] + [merged]
        res[f"inc_written_{block}"] = store.bytes_written
        res[f"inc_compaction_read_{block}"] = store.bytes_read
        res["changed_bytes"] = changed_bytes
        first_write = sum(  # one round, no compaction: the run alone
            len(k) + len(v) for k, v in changes(args.keys, 1)
        )
        res["changed_bytes_round"] = first_write
        manifest = {"runs": [r.__dict__ for r in runs[::-1]], "small": small_meta.__dict__}
        store.put("manifest.json", json.dumps(manifest).encode())
        res[f"total_{block}"] = sum(r.total for r in runs)
        res[f"runs_{block}"] = len(runs)
        # Rescale: blocks of every run overlapping the new instance's key range + indexes.
        lo, hi = kg_bounds(*RESCALE)
        reader = RunsReader(store, runs[::-1], Path(args.work) / f"clip-{block}", 0)
        need = 0
        for run in reader.runs:
            need += run.meta.index_bytes
            for b in range(len(run.first)):
                if run.last[b] >= lo and run.first[b] < hi:
                    need += run.length[b]
        res[f"clip_bytes_{block}"] = need
    return res


def arrow_read(args: argparse.Namespace) -> dict[str, Any]:
    """Cold (empty cache dir) then warm point reads, in a fresh process."""
    res: dict[str, Any] = {}
    block = args.block
    store = open_store(args, f"arrow-{block}")
    manifest = json.loads(store.get("manifest.json"))
    runs = [RunMeta(**r) for r in manifest["runs"]]
    for label, count, seed in (("b", BATCH, 1), ("p", max(1, args.keys // 1000), 2)):
        ns = read_sample(args.keys, count, seed)
        want = expected(args.keys, ns, args.rounds)
        keys = sorted(want)
        cache = Path(args.work) / f"cache-{block}-{label}"
        shutil.rmtree(cache, ignore_errors=True)
        store.reset()
        t = time.monotonic()
        reader = RunsReader(store, runs, cache, args.max_gap)
        got = reader.get_many(keys)
        res[f"cold_s_{label}"] = time.monotonic() - t
        res[f"cold_bytes_{label}"] = store.bytes_read
        res[f"cold_requests_{label}"] = store.requests["get"] + store.requests["get_range"]
        assert got == want, f"arrow-runs read {len(got)} of {len(want)} keys, or wrong values"
        t = time.monotonic()
        got = reader.get_many(keys)
        res[f"warm_s_{label}"] = time.monotonic() - t
        assert got == want
    small_store = open_store(args, f"arrow-small-{block}")
    small = RunMeta(**manifest["small"])
    cache = Path(args.work) / f"cache-small-{block}"
    reader = RunsReader(small_store, [small], cache, args.max_gap)
    keys = sorted(db_key(n) for n in range(BATCH))
    reader.get_many(keys)
    t = time.monotonic()
    got = reader.get_many(keys)
    res["warm_small_s"] = time.monotonic() - t
    assert len(got) == len(keys)
    res["rss_mb"] = peak_rss_mb()
    return res


# --- rocksdict --------------------------------------------------------------------------
def rocks_options() -> Any:
    """zstd, 4 KB blocks (the default), a 10-bit bloom, a 256 MB block cache."""
    import rocksdict as r

    opts = r.Options(raw_mode=True)
    opts.create_if_missing(True)
    opts.set_compression_type(r.DBCompressionType.zstd())
    table = r.BlockBasedOptions()
    table.set_bloom_filter(10, False)
    table.set_block_cache(r.Cache(256 << 20))
    opts.set_block_based_table_factory(table)
    opts.increase_parallelism(2)
    return opts


def rocks_wait(db: Any) -> None:
    """Until background compactions are done (their output is part of the checkpoint)."""
    time.sleep(0.5)  # let the flush schedule its compaction
    for _ in range(600):
        busy = db.property_int_value("rocksdb.compaction-pending") or 0
        busy += db.property_int_value("rocksdb.num-running-compactions") or 0
        busy += db.property_int_value("rocksdb.num-running-flushes") or 0
        if not busy:
            return
        time.sleep(0.1)


def rocks_checkpoint(db: Any, work: Path, store: CountingStore, uploaded: set[str]) -> list[str]:
    """Flink-style incremental checkpoint: upload files of a RocksDB checkpoint S3 lacks."""
    import rocksdict as r

    path = work / f"ckpt-{time.monotonic_ns()}"
    r.Checkpoint(db).create_checkpoint(str(path))
    names = sorted(os.listdir(path))
    for name in names:
        if not name.endswith(".sst") or name not in uploaded:
            store.put(f"files/{name}", (path / name).read_bytes())
            uploaded.add(name)
    shutil.rmtree(path)
    return names


def rocks_build(args: argparse.Namespace) -> dict[str, Any]:
    import rocksdict as r

    res: dict[str, Any] = {}
    work = Path(args.work) / "rocks"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    store = open_store(args, "rocks")
    opts = rocks_options()
    t = time.monotonic()
    keys, values = all_entries(args.keys)
    res["gen_s"] = time.monotonic() - t
    t = time.monotonic()
    per_file = 500_000  # SST files of ~8 MB: a restore can skip non-overlapping ones
    paths = []
    for s in range(0, len(keys), per_file):
        w = r.SstFileWriter(options=opts)
        path = work / f"ingest-{s // per_file:04d}.sst"
        w.open(str(path))
        for k, v in zip(keys[s : s + per_file], values[s : s + per_file], strict=True):
            w[k] = v
        w.finish()
        paths.append(str(path))
    del keys, values
    db = r.Rdict(str(work / "db"), opts)
    ingest = r.IngestExternalFileOptions()
    ingest.set_move_files(True)
    db.ingest_external_file(paths, ingest)
    uploaded: set[str] = set()
    names = rocks_checkpoint(db, work, store, uploaded)
    res["build_s"] = time.monotonic() - t
    res["base_upload"] = store.bytes_written
    store.reset()
    changed_bytes = 0
    for rnd in range(1, args.rounds + 1):
        ch = changes(args.keys, rnd)
        changed_bytes += sum(len(k) + len(v) for k, v in ch)
        wb = r.WriteBatch(raw_mode=True)
        for k, v in ch:
            wb.put(k, v)
        db.write(wb)
        db.flush()
        rocks_wait(db)
        names = rocks_checkpoint(db, work, store, uploaded)
        if rnd == 1:
            res["inc_written_round1"] = store.bytes_written
    res["inc_written"] = store.bytes_written
    res["changed_bytes"] = changed_bytes
    res["changed_bytes_round"] = sum(len(k) + len(v) for k, v in changes(args.keys, 1))
    files = db.live_files()
    res["total"] = sum(f["size"] for f in files)
    res["levels"] = sorted({f["level"] for f in files})
    res["files"] = len(files)
    store.put("manifest.json", json.dumps(names).encode())
    lo, hi = kg_bounds(*RESCALE)
    res["clip_bytes"] = sum(f["size"] for f in files if f["end_key"] >= lo and f["start_key"] < hi)
    t = time.monotonic()
    db.delete_range(b"\x00", lo)
    db.delete_range(hi, b"\xff\xff")
    db.compact_range(None, None)
    res["clip_s"] = time.monotonic() - t
    db.close()
    return res


def rocks_read(args: argparse.Namespace) -> dict[str, Any]:
    """Cold = download every file of the checkpoint, open, multi_get; then warm."""
    import rocksdict as r

    res: dict[str, Any] = {}
    store = open_store(args, "rocks")
    ns = read_sample(args.keys, BATCH, 1)
    want = expected(args.keys, ns, args.rounds)
    keys = sorted(want)
    local = Path(args.work) / "rocks-restore"
    shutil.rmtree(local, ignore_errors=True)
    local.mkdir(parents=True)
    store.reset()
    t = time.monotonic()
    names = json.loads(store.get("manifest.json"))
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        blobs = list(pool.map(lambda n: store.get(f"files/{n}"), names))
    for name, blob in zip(names, blobs, strict=True):
        (local / name).write_bytes(blob)
    res["download_s"] = time.monotonic() - t
    db = r.Rdict(str(local), rocks_options())
    got = dict(zip(keys, db.get(keys), strict=True))
    res["cold_s_b"] = time.monotonic() - t
    res["cold_bytes_b"] = store.bytes_read
    res["cold_requests_b"] = store.requests["get"] + store.requests["get_range"]
    assert got == want, "rocksdict read wrong values"
    t = time.monotonic()
    got = dict(zip(keys, db.get(keys), strict=True))
    res["warm_s_b"] = time.monotonic() - t
    db.close()
    small_path = Path(args.work) / "rocks-small"
    shutil.rmtree(small_path, ignore_errors=True)
    small = r.Rdict(str(small_path), rocks_options())
    skeys = sorted(db_key(n) for n in range(BATCH))
    wb = r.WriteBatch(raw_mode=True)
    for n in range(BATCH):
        wb.put(db_key(n), base_value(n))
    small.write(wb)
    small.flush()
    small.get(skeys)
    t = time.monotonic()
    small.get(skeys)
    res["warm_small_s"] = time.monotonic() - t
    small.close()
    res["rss_mb"] = peak_rss_mb()
    return res


# --- slatedb ----------------------------------------------------------------------------
class CountingProxy:
    """An HTTP proxy in front of SeaweedFS's S3 port counting bytes per method.

    slatedb exposes no byte counters; SigV4 signs the Host header, which we pass through
    unchanged, so requests stay valid.
    """

    def __init__(self, upstream_port: int) -> None:
        self.counts: dict[str, int] = {}
        self.lock = threading.Lock()
        self.local = threading.local()
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a: Any) -> None:
                pass

            def _relay(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                headers = {
                    k: v
                    for k, v in self.headers.items()
                    if k.lower() not in ("connection", "expect")
                }
                conn = getattr(proxy.local, "conn", None)
                if conn is None:  # one upstream connection per proxy thread, kept alive
                    conn = http.client.HTTPConnection("127.0.0.1", upstream_port, timeout=120)
                    proxy.local.conn = conn
                try:
                    conn.request(self.command, self.path, body=body, headers=headers)
                    resp = conn.getresponse()
                    data = resp.read()
                except (OSError, http.client.HTTPException):
                    conn.close()
                    conn.request(self.command, self.path, body=body, headers=headers)
                    resp = conn.getresponse()
                    data = resp.read()
                proxy.add(f"{self.command}_requests", 1)
                proxy.add(f"{self.command}_in", length)
                proxy.add(f"{self.command}_out", len(data))
                self.send_response(resp.status, resp.reason)
                for k, v in resp.getheaders():
                    if k.lower() not in ("transfer-encoding", "connection", "content-length"):
                        self.send_header(k, v)
                size = resp.getheader("Content-Length") if self.command == "HEAD" else None
                self.send_header("Content-Length", size or str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _relay

        http.server.ThreadingHTTPServer.request_queue_size = 1024  # slatedb opens many
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def add(self, name: str, n: int) -> None:
        with self.lock:
            self.counts[name] = self.counts.get(name, 0) + n

    def take(self) -> dict[str, int]:
        with self.lock:
            out, self.counts = self.counts, {}
        return out


def slate_store(args: argparse.Namespace) -> Any:
    from slatedb.uniffi import ObjectStoreBuilder, ObjectStoreType

    if args.local:
        b = ObjectStoreBuilder(ObjectStoreType.LOCAL)
        root = Path(args.work) / "slatedb-local"
        root.mkdir(parents=True, exist_ok=True)
        b.with_config("local_path", str(root))
        return b.build()
    from microbatch.settings import Settings

    settings = Settings.from_env(s3_endpoint_url=args.endpoint, home=str(REPO / ".local"))
    b = ObjectStoreBuilder(ObjectStoreType.S3)
    for k, v in {
        "endpoint": f"http://127.0.0.1:{args.proxy_port}",
        "allow_http": "true",
        "bucket": settings.s3_bucket,
        "region": settings.s3_region,
        "access_key_id": settings.s3_access_key_id,
        "secret_access_key": settings.s3_secret_access_key,
        "virtual_hosted_style_request": "false",
    }.items():
        b.with_config(k, v)
    return b.build()


def slate_sizes(args: argparse.Namespace) -> dict[str, int]:
    """Bytes stored by slatedb per top folder (wal/, compacted/, manifest/, ...)."""
    sizes: dict[str, int] = {}
    if args.local:
        root = Path(args.work) / "slatedb-local" / "spike" / "slatedb"
        for path in root.rglob("*"):
            if path.is_file():
                top = path.relative_to(root).parts[0]
                sizes[top] = sizes.get(top, 0) + path.stat().st_size
        return sizes
    import boto3

    from microbatch.settings import Settings

    settings = Settings.from_env(s3_endpoint_url=args.endpoint, home=str(REPO / ".local"))
    client = boto3.client("s3", **settings.boto3_client_kwargs())
    pages = client.get_paginator("list_objects_v2").paginate(
        Bucket=settings.s3_bucket, Prefix="spike/slatedb/"
    )
    for page in pages:
        for obj in page.get("Contents", []):
            top = obj["Key"].split("/")[2]
            sizes[top] = sizes.get(top, 0) + obj["Size"]
    return sizes


def slate_db(args: argparse.Namespace) -> Any:
    """A writer builder with zstd (as the other candidates) and otherwise the defaults."""
    from slatedb.uniffi import DbBuilder, Settings

    settings = Settings.default()
    settings.set("compression_codec", '"Zstd"')
    builder = DbBuilder("spike/slatedb", slate_store(args))
    builder.with_settings(settings)
    return builder


def slate_build(args: argparse.Namespace) -> dict[str, Any]:
    return asyncio.run(_slate_build(args))


async def _slate_build(args: argparse.Namespace) -> dict[str, Any]:
    from slatedb.uniffi import WriteBatch

    res: dict[str, Any] = {}
    t = time.monotonic()
    keys, values = all_entries(args.keys)
    res["gen_s"] = time.monotonic() - t
    db = await slate_db(args).build()
    t = time.monotonic()
    for s in range(0, len(keys), 10_000):
        wb = WriteBatch()
        for k, v in zip(keys[s : s + 10_000], values[s : s + 10_000], strict=True):
            wb.put(k, v)
        await db.write(wb)
    await db.flush()
    res["build_s"] = time.monotonic() - t
    del keys, values
    await db.shutdown()
    res["sizes"] = slate_sizes(args)
    return res


def slate_write(args: argparse.Namespace) -> dict[str, Any]:
    return asyncio.run(_slate_write(args))


async def _slate_write(args: argparse.Namespace) -> dict[str, Any]:
    """``--rounds`` batches of changes, each flushed (the checkpoint), in a writer process."""
    from slatedb.uniffi import WriteBatch

    res: dict[str, Any] = {}
    db = await slate_db(args).build()
    changed = 0
    t = time.monotonic()
    for rnd in range(1, args.rounds + 1):
        ch = changes(args.keys, rnd)
        changed += sum(len(k) + len(v) for k, v in ch)
        wb = WriteBatch()
        for k, v in ch:
            wb.put(k, v)
        await db.write(wb)
        await db.flush()
    res["write_s"] = time.monotonic() - t
    await asyncio.sleep(15)  # the compactor polls every 5 s: let it merge what was flushed
    res["changed_bytes"] = changed
    res["changed_bytes_round"] = sum(len(k) + len(v) for k, v in changes(args.keys, 1))
    await db.shutdown()
    res["sizes"] = slate_sizes(args)
    return res


def slate_read(args: argparse.Namespace) -> dict[str, Any]:
    return asyncio.run(_slate_read(args))


async def _slate_read(args: argparse.Namespace) -> dict[str, Any]:
    """A fresh read-only reader: cold gets of the batch's keys, then warm ones."""
    from slatedb.uniffi import DbReaderBuilder

    res: dict[str, Any] = {}
    label = args.label
    count, seed = (BATCH, 1) if label == "b" else (max(1, args.keys // 1000), 2)
    ns = read_sample(args.keys, count, seed)
    want = expected(args.keys, ns, args.rounds if args.after_writes else 0)
    keys = sorted(want)
    t = time.monotonic()
    reader = await DbReaderBuilder("spike/slatedb", slate_store(args)).build()
    got = await _slate_gets(reader, keys)
    res[f"cold_s_{label}"] = time.monotonic() - t
    assert got == want, f"slatedb read {len(got)} of {len(want)} keys, or wrong values"
    t = time.monotonic()
    got = await _slate_gets(reader, keys)
    res[f"warm_s_{label}"] = time.monotonic() - t
    await reader.shutdown()
    res["rss_mb"] = peak_rss_mb()
    return res


async def _slate_gets(reader: Any, keys: Sequence[bytes]) -> dict[bytes, bytes]:
    sem = asyncio.Semaphore(64)

    async def one(k: bytes) -> bytes | None:
        async with sem:
            return await reader.get(k)

    values = await asyncio.gather(*(one(k) for k in keys))
    return {k: v for k, v in zip(keys, values, strict=True) if v is not None}


PHASES = {
    "arrow-build": arrow_build,
    "arrow-read": arrow_read,
    "rocks-build": rocks_build,
    "rocks-read": rocks_read,
    "slate-build": slate_build,
    "slate-write": slate_write,
    "slate-read": slate_read,
}


# --- orchestration ----------------------------------------------------------------------
class Runner:
    """Runs each phase in a fresh interpreter and collects its JSON result."""

    def __init__(self, args: argparse.Namespace, proxy: CountingProxy | None) -> None:
        self.args, self.proxy = args, proxy

    def phase(self, name: str, *extra: str) -> dict[str, Any]:
        a = self.args
        argv = [sys.executable, __file__, "--phase", name, "--keys", str(a.keys)]
        argv += ["--work", a.work, "--max-gap", str(a.max_gap)]
        argv += ["--blocks", ",".join(map(str, a.blocks)), "--rounds", str(a.rounds)]
        argv += ["--local"] if a.local else ["--endpoint", a.endpoint]
        if self.proxy is not None:
            argv += ["--proxy-port", str(self.proxy.port)]
            self.proxy.take()
        argv += list(extra)
        print(f"[spike] {name} {' '.join(extra)} ...", flush=True)
        t = time.monotonic()
        try:
            proc = subprocess.run(
                argv, capture_output=True, text=True, check=False, timeout=self.args.timeout
            )
        except subprocess.TimeoutExpired:
            print(f"[spike] {name}: no result after {self.args.timeout}s", flush=True)
            return {"error": f"no result after {self.args.timeout}s", "wall_s": self.args.timeout}
        wall = time.monotonic() - t
        if proc.returncode != 0:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-8:]
            print("\n".join(f"    {line}" for line in tail), flush=True)
            return {"error": tail[-1] if tail else f"exit {proc.returncode}", "wall_s": wall}
        result = json.loads(proc.stdout.strip().splitlines()[-1])
        result["wall_s"] = wall
        if self.proxy is not None:
            result["proxy"] = self.proxy.take()
        print(f"[spike] {name}: {json.dumps(result)}", flush=True)
        return result


def ratio(a: float | None, b: float | None) -> str:
    return "n/a" if a is None or not b else f"{a / b:.3f}"


def cold_note(nbytes: int | None, total: int, requests: Any) -> str:
    return f"{(nbytes or 0) / 1e6:.2f} MB = {ratio(nbytes, total)} of state, {requests} GETs"


def run_all(args: argparse.Namespace, runner: Runner) -> list[tuple[str, str, str]]:
    """Every candidate's phases, then one table row per measurement."""
    rows: list[tuple[str, str, str]] = []
    only = set(args.only.split(","))
    frac = share_fraction(args.keys, *RESCALE)
    point = f"{max(1, args.keys // 1000):,} keys = 0.1%"

    def add(name: str, value: str, note: str) -> None:
        rows.append((name, value, note))
        print(f"[row] {name} = {value}  ({note})", flush=True)

    def ms(seconds: float) -> str:
        return f"{seconds * 1000:.0f} ms"

    if "arrow-runs" in only:
        b = runner.phase("arrow-build")
        for block in args.blocks:
            r = runner.phase("arrow-read", "--block", str(block))
            if "error" in b or "error" in r:
                continue
            tag = f"arrow-runs {block / 1024:g} KB"
            total = b[f"total_{block}"]
            note = f"base run {b[f'build_s_{block}']:.1f}s (+{b['gen_s']:.1f}s data); "
            note += f"{b[f'runs_{block}']} runs after {args.rounds} rounds"
            add(f"{tag}: total state", f"{total / 1e6:.1f} MB", note)
            for label, what in (("b", "10k keys"), ("p", point)):
                note = cold_note(r[f"cold_bytes_{label}"], total, r[f"cold_requests_{label}"])
                add(f"{tag}: cold read {what}", f"{r[f'cold_s_{label}']:.2f}s", note)
                add(f"{tag}: warm read {what}", ms(r[f"warm_s_{label}"]), "local sparse copy")
            note = f"{ms(r['warm_small_s'])} over a 10k-key state"
            add(f"{tag}: warm 10k over N ÷ over 10k", ratio(r["warm_s_b"], r["warm_small_s"]), note)
            written, read = b[f"inc_written_{block}"], b[f"inc_compaction_read_{block}"]
            note = f"{written / 1e6:.2f} MB written, {read / 1e6:.2f} MB read by compaction"
            value = ratio(written, b["changed_bytes"])
            add(f"{tag}: write / changed ({args.rounds} rounds + compaction)", value, note)
            value = ratio(b[f"clip_bytes_{block}"], total * frac)
            add(f"{tag}: rescale 2→3 read / share", value, "overlapping blocks + indexes")
            add(f"{tag}: peak RSS (reads)", f"{r['rss_mb']:.0f} MB", "fresh process")
    if "rocksdict" in only:
        b, r = runner.phase("rocks-build"), runner.phase("rocks-read")
        if "error" not in b and "error" not in r:
            note = f"SstFileWriter+ingest {b['build_s']:.1f}s (+{b['gen_s']:.1f}s data); "
            note += f"after rounds {b['files']} SSTs, levels {b['levels']}"
            add("rocksdict: total state", f"{b['total'] / 1e6:.1f} MB", note)
            note = cold_note(r["cold_bytes_b"], b["total"], r["cold_requests_b"])
            note += f", download {r['download_s']:.1f}s"
            add("rocksdict: cold read 10k keys (download all)", f"{r['cold_s_b']:.2f}s", note)
            add("rocksdict: warm read 10k keys", ms(r["warm_s_b"]), "multi_get")
            note = f"{ms(r['warm_small_s'])} over a 10k-key state"
            value = ratio(r["warm_s_b"], r["warm_small_s"])
            add("rocksdict: warm 10k over N ÷ over 10k", value, note)
            value = ratio(b["inc_written_round1"], b["changed_bytes_round"])
            add("rocksdict: write / changed (1 round)", value, "new SST + MANIFEST/OPTIONS")
            note = f"{b['inc_written'] / 1e6:.1f} MB uploaded, default leveled compaction"
            value = ratio(b["inc_written"], b["changed_bytes"])
            add(f"rocksdict: write / changed ({args.rounds} rounds + compaction)", value, note)
            note = f"whole overlapping SSTs; delete_range + compact {b['clip_s']:.1f}s"
            value = ratio(b["clip_bytes"], b["total"] * frac)
            add("rocksdict: rescale 2→3 read / share", value, note)
            add("rocksdict: peak RSS (reads)", f"{r['rss_mb']:.0f} MB", "fresh process")
    if "slatedb" in only:
        add_slatedb(args, runner, add, point)
    return rows


def add_slatedb(args: argparse.Namespace, runner: Runner, add: Any, point: str) -> None:
    b = runner.phase("slate-build")
    if "error" in b:
        add("slatedb: build", "failed", b["error"])
        return
    written = b.get("proxy", {}).get("PUT_in")
    sst = b["sizes"].get("compacted", 0)
    note = f"WriteBatch+flush {b['build_s']:.1f}s (+{b['gen_s']:.1f}s data); "
    note += f"{(written or 0) / 1e6:.1f} MB PUT; stored {b['sizes']}"
    add("slatedb: total state (SSTs)", f"{sst / 1e6:.1f} MB", note)
    for label, what in (("b", "10k keys"), ("p", point)):
        r = runner.phase("slate-read", "--label", label)
        if "error" in r:
            add(f"slatedb: cold read {what}", "failed", r["error"])
            continue
        proxy = r.get("proxy", {})
        note = cold_note(proxy.get("GET_out"), sst, proxy.get("GET_requests"))
        add(f"slatedb: cold read {what}", f"{r[f'cold_s_{label}']:.2f}s", note + ", new reader")
        note = f"in-memory block cache; peak RSS {r['rss_mb']:.0f} MB"
        add(f"slatedb: warm read {what}", f"{r[f'warm_s_{label}'] * 1000:.0f} ms", note)
    w = runner.phase("slate-write")
    if "error" not in w:
        put = w.get("proxy", {}).get("PUT_in", 0)
        note = f"{put / 1e6:.1f} MB PUT (WAL, L0, manifest, compaction while open), "
        note += f"{w['write_s']:.1f}s; stored {w['sizes']}"
        add(
            f"slatedb: write / changed ({args.rounds} rounds)", ratio(put, w["changed_bytes"]), note
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--keys", type=int, default=2_000_000)
    parser.add_argument("--local", action="store_true", help="local folder instead of S3")
    parser.add_argument("--only", default="arrow-runs,rocksdict,slatedb")
    parser.add_argument(
        "--blocks", default="65536,4096,1536", help="arrow-runs block sizes, compressed bytes"
    )
    parser.add_argument(
        "--max-gap", type=int, default=4096, help="coalesce ranged GETs across gaps this small"
    )
    parser.add_argument("--rounds", type=int, default=8, help="incremental checkpoints")
    parser.add_argument("--timeout", type=int, default=420, help="seconds per phase")
    # internal: one phase in a worker process
    parser.add_argument("--phase", choices=sorted(PHASES))
    parser.add_argument("--work", default="")
    parser.add_argument("--endpoint", default="")
    parser.add_argument("--proxy-port", type=int, default=0)
    parser.add_argument("--block", type=int, default=65536)
    parser.add_argument("--label", default="b")
    parser.add_argument("--after-writes", action="store_true")
    args = parser.parse_args()
    args.blocks = [int(b) for b in str(args.blocks).split(",")]
    if args.phase:
        print(json.dumps(PHASES[args.phase](args)))
        return
    with services(args) as proxy:
        rows = run_all(args, Runner(args, proxy))
    if rows:
        print_table(rows)
    print(f"\nload: {subprocess.run(['uptime'], capture_output=True, text=True).stdout.strip()}")


@contextlib.contextmanager
def services(args: argparse.Namespace) -> Iterator[CountingProxy | None]:
    """SeaweedFS on free loopback ports + the counting proxy (or a temp folder)."""
    args.work = tempfile.mkdtemp(prefix="spike-state-")
    if args.local:
        try:
            yield None
        finally:
            shutil.rmtree(args.work, ignore_errors=True)
        return
    from microbatch.localstack import SeaweedFS
    from microbatch.localstack.process import free_port_block
    from microbatch.localstack.seaweedfs import ALL_OFFSETS
    from microbatch.settings import Settings

    port = free_port_block(ALL_OFFSETS)
    args.endpoint = f"http://127.0.0.1:{port}"
    settings = Settings.from_env(s3_endpoint_url=args.endpoint, home=str(REPO / ".local"))
    seaweed = SeaweedFS(settings, Path(args.work) / "seaweedfs")
    print(f"starting SeaweedFS at {args.endpoint} ...", flush=True)
    seaweed.start()
    proxy = CountingProxy(port)
    try:
        yield proxy
    finally:
        proxy.server.shutdown()
        seaweed.stop()
        shutil.rmtree(args.work, ignore_errors=True)


if __name__ == "__main__":
    main()
