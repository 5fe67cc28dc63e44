"""Keyed-state checkpoints: requests per checkpoint, incremental bytes, rescale reads.

For 1M keys over max_parallelism 128, written at parallelism 2, against a SeaweedFS this
script starts on free loopback ports (``--local`` uses a temporary folder instead):

- PUT requests per checkpoint — target: one per active instance + 1 (the manifest),
  whatever max_parallelism is (a second run at max_parallelism 1024 shows it);
- bytes written by an incremental checkpoint where 10% of the key-groups changed —
  target: ≤ 15% of the full checkpoint measured in the same run;
- bytes read per instance when restoring at parallelism 3 after writing at 2 — target:
  ≤ 1.1 × that instance's share (the sum of its key-groups' sizes in the manifest).

    .venv/bin/python bench/bench_state.py [--keys 1000000] [--max-parallelism 128] [--local]
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path

from benchlib import print_table

from microbatch.checkpoint import Layout, checkpoint, restore_instance
from microbatch.checkpoint.restore import empty_backends
from microbatch.keygroups import key_group, key_group_range, operator_index
from microbatch.localstack import SeaweedFS
from microbatch.localstack.process import free_port_block
from microbatch.localstack.seaweedfs import ALL_OFFSETS
from microbatch.settings import Settings
from microbatch.storage import LocalFileStore, ObjectStore, S3Store
from microbatch.storage.counting import CountingStore

REPO = Path(__file__).resolve().parents[1]


def populate(backends, n_keys: int, max_p: int) -> dict[int, list[str]]:
    """One value state (a small dict) per key, through the public state API."""
    p = len(backends)
    keys_by_group: dict[int, list[str]] = {}
    for k in range(n_keys):
        key = f"user-{k}"
        kg = key_group(key, max_p)
        keys_by_group.setdefault(kg, []).append(key)
        ctx = backends[operator_index(kg, max_p, p)].for_key(key)
        ctx.value("profile").set({"count": k % 1000, "last": k * 7})
    return keys_by_group


def run(store: CountingStore, n_keys: int, max_p: int, label: str) -> list[tuple[str, str, str]]:
    layout = Layout(f"bench/{label}/")
    rows: list[tuple[str, str, str]] = []
    backends = empty_backends(max_p, 2)
    t = time.monotonic()
    keys_by_group = populate(backends, n_keys, max_p)
    print(f"[{label}] populated {n_keys:,} keys in {time.monotonic() - t:.1f}s")

    store.reset()
    t = time.monotonic()
    full = checkpoint(store, layout, backends, 1, base=None, pipeline_fingerprint="bench")
    puts_full = store.requests["put"] + store.requests["create"]
    full_bytes = store.bytes_written
    print(f"[{label}] full checkpoint: {full_bytes:,} bytes in {time.monotonic() - t:.1f}s")
    rows.append((f"PUTs, full checkpoint (maxP {max_p}, P=2)", f"{puts_full}", "target 3 (2+1)"))

    changed = random.Random(7).sample(sorted(keys_by_group), max(1, max_p // 10))
    for kg in changed:
        backend = backends[operator_index(kg, max_p, 2)]
        for key in keys_by_group[kg][::10]:  # update 10% of the keys of each changed group
            backend.for_key(key).value("profile").set({"count": -1})
    store.reset()
    inc = checkpoint(store, layout, backends, 2, base=full, pipeline_fingerprint="bench")
    puts_inc = store.requests["put"] + store.requests["create"]
    inc_bytes = store.bytes_written
    active = len({operator_index(kg, max_p, 2) for kg in changed})
    rows.append(
        (
            f"PUTs, incremental ({len(changed)}/{max_p} groups)",
            f"{puts_inc}",
            f"target {active + 1} ({active}+1)",
        )
    )
    rows.append(
        (
            "incremental bytes / full bytes",
            f"{inc_bytes / full_bytes:.3f}",
            f"{inc_bytes:,} / {full_bytes:,}; target ≤ 0.15",
        )
    )
    assert inc.checkpoint_id == 2

    for i in range(3):
        store.reset()
        t = time.monotonic()
        backend, stats = restore_instance(store, full, 3, i)
        elapsed = time.monotonic() - t
        own = key_group_range(max_p, 3, i)
        share = sum(full.key_groups[kg].length for kg in own if full.key_groups[kg])
        rows.append(
            (
                f"restore P'=3 inst {i} ({own}): read/share",
                f"{store.bytes_read / share:.3f}",
                f"{store.bytes_read:,} B in {stats.requests} GETs, {elapsed:.1f}s; "
                f"share/total={share / full.total_bytes:.3f}; target ≤ 1.1",
            )
        )
        assert len(backend.keys()) == sum(len(keys_by_group.get(kg, [])) for kg in own)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--keys", type=int, default=1_000_000)
    parser.add_argument("--max-parallelism", type=int, default=128)
    parser.add_argument("--local", action="store_true", help="local folder instead of S3")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-state-"))
    seaweed = None
    if args.local:
        inner: ObjectStore = LocalFileStore(work / "store")
    else:
        settings = Settings.from_env(
            s3_endpoint_url=f"http://127.0.0.1:{free_port_block(ALL_OFFSETS)}",
            home=str(REPO / ".local"),
        )
        seaweed = SeaweedFS(settings, work / "seaweedfs")
        print(f"starting SeaweedFS at {settings.s3_endpoint_url} ...")
        seaweed.start()
        inner = S3Store(settings.s3_bucket, "bench-state", settings)
    try:
        store = CountingStore(inner)
        print(f"store: {inner.url}")
        rows = run(store, args.keys, args.max_parallelism, f"maxp{args.max_parallelism}")
        rows += run(store, args.keys // 10, 1024, "maxp1024")[:2]
        print_table(rows)
    finally:
        if seaweed is not None:
            seaweed.stop()


if __name__ == "__main__":
    main()
