"""Writing a batch's changed keys to state: the many-keys path against the key-by-key one.

At the end of a batch each stage-2 instance turns the keys it changed into run entries
(``changed_entries``), cuts them into LZ4 blocks (``encode_run``) and keeps the run in
its local block cache (``BlockCache.keep_run``); a later batch decodes blocks back
(``decode_batch``). A table join's table or a running total changes 100k keys a batch,
each holding one value state and no timers. This bench builds such an instance (``--keys``
keys, values like Nexmark's people) and times, in one process with the collector off (as
in a stage-2 task), alternating over ``--rounds`` rounds:

- ``entries``: the many-keys path of ``changed_entries`` against exporting each key's rows
  (``_entries_per_key``, the path of keys with timers or several states) — same entries;
- ``encode``: ``encode_run`` with blocks compressed on the calling thread (the setting)
  against Arrow's thread pool — same bytes;
- ``decode``: one block read on the calling thread against the thread pool;
- ``keep``: the run kept as one file of blocks (``keep_run``) against one file per block.

It prints CPU seconds (median and best) per path and the ratio reference ÷ ours.

    .venv/bin/python bench/bench_state_write.py [--keys 100000] [--rounds 5]
"""

from __future__ import annotations

import argparse
import gc
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.ipc as ipc
from benchlib import load, log, print_ratios

from microbatch.keygroups import KeyGroupRange, encode_key, key_group_of_bytes
from microbatch.state.backend import KeyedStateBackend
from microbatch.state.codec import encode_values
from microbatch.state.engine import instance, runs
from microbatch.state.engine.blockcache import BlockCache, RunRef
from microbatch.storage import open_store

MAXP = 128


def backend_of(keys: int) -> KeyedStateBackend:
    """An instance whose ``keys`` keys each had one value state set this batch."""
    backend = KeyedStateBackend(MAXP, KeyGroupRange(0, MAXP - 1))
    backend.declare("table", "value", None)
    people = [{"id": i, "name": f"person {i}", "city": "boise", "state": "id"} for i in range(keys)]
    for i, data in enumerate(encode_values(people)):
        kb = encode_key(i)
        kg = key_group_of_bytes(kb, MAXP)
        backend.table(kg, "table", create=True)[kb] = (data, None)  # type: ignore[index]
        backend.touch(kg, kb, None)
    return backend


def cpu(work: Callable[[], Any]) -> tuple[float, Any]:
    started = time.process_time()
    result = work()
    return time.process_time() - started, result


def keep_per_block(cache: BlockCache, ref: RunRef, plain: list[pa.RecordBatch]) -> None:
    """The run kept as before: one file per block."""
    for n, batch in enumerate(plain):
        cache._keep_plain(ref, n, batch)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keys", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    log(f"{args.keys:,} keys of one value state ({load()})")
    backend = backend_of(args.keys)
    times: dict[str, list[float]] = {}
    threaded = ipc.IpcWriteOptions(compression="lz4", use_threads=True)
    own = runs._OPTIONS
    gc.disable()
    with tempfile.TemporaryDirectory(prefix="bench-state-write-") as tmp:
        store = open_store(str(Path(tmp) / "store"))
        for r in range(args.rounds):
            loaded = instance.Loaded()
            t, fast = cpu(lambda: instance.changed_entries(backend, loaded))  # noqa: B023
            times.setdefault("entries: many keys", []).append(t)
            t, slow = cpu(lambda: sorted(instance._entries_per_key(backend, instance.Loaded())))
            times.setdefault("entries: key by key", []).append(t)
            if fast != slow:
                raise SystemExit("the two paths gave different entries")
            plain: list[pa.RecordBatch] = []
            t, (data, index) = cpu(lambda: runs.encode_run(fast, plain=plain))  # noqa: B023
            times.setdefault("encode: one thread", []).append(t)
            runs._OPTIONS = threaded
            try:
                t, (pooled, _) = cpu(lambda: runs.encode_run(fast))  # noqa: B023
            finally:
                runs._OPTIONS = own
            times.setdefault("encode: thread pool", []).append(t)
            if pooled != data:
                raise SystemExit("the two encodings differ")
            blocks = [(data[b.offset : b.offset + b.length], b) for b in index.blocks]
            t, _ = cpu(lambda: [runs.decode_batch(d, b, "bench") for d, b in blocks])  # noqa: B023
            times.setdefault("decode: one thread", []).append(t)
            t, _ = cpu(
                lambda: [
                    ipc.read_record_batch(ipc.read_message(pa.py_buffer(d)), runs.SCHEMA)
                    for d, _ in blocks  # noqa: B023
                ]
            )
            times.setdefault("decode: thread pool", []).append(t)
            ref = RunRef(f"r{r}.arrow", f"r{r}.index.arrow", 0, MAXP - 1, len(data))
            index_bytes = index.to_bytes()
            one = BlockCache(store, Path(tmp) / f"one-{r}")
            t, _ = cpu(lambda: one.keep_run(ref, data, index_bytes, plain))  # noqa: B023
            times.setdefault("keep: one file", []).append(t)
            each = BlockCache(store, Path(tmp) / f"each-{r}")
            t, _ = cpu(lambda: keep_per_block(each, ref, plain))  # noqa: B023
            times.setdefault("keep: file per block", []).append(t)
            log(f"round {r + 1}: {len(fast):,} entries, {len(index.blocks):,} blocks, {load()}")
    gc.enable()
    pairs = [
        ("entries: many keys", "entries: key by key"),
        ("encode: one thread", "encode: thread pool"),
        ("decode: one thread", "decode: thread pool"),
        ("keep: one file", "keep: file per block"),
    ]
    print_ratios(times, pairs)  # path, CPU-s median (best), reference ÷ ours
    log(f"{args.rounds} rounds; now {load()}")


if __name__ == "__main__":
    main()
