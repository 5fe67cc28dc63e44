"""Publishing a batch to the Delta sink vs the Parquet sink, same rows, same store, one run.

One batch of ``--rows`` records ``{"user", "page", "ts", "clicks", "total"}`` (10,000
users), split over 2 operator instances as stage 2 would hand them to a sink, is published
through each sink the way the runtime does it: ``stage(ctx, rows)`` for every instance
(records → Arrow → Parquet bytes → the store; the Delta sink also checks the table's
schema, computes file statistics and writes its staging index), then ``publish(ctx)`` once
on the "driver" (Parquet: the ``_commits`` entry; Delta: reading the table's snapshot and
one commit with the app transaction). Both sinks write to the same store: a SeaweedFS S3
bucket started on free loopback ports (or ``MICROBATCH_S3_ENDPOINT_URL``), or a local
folder with ``--local``. Each repeat publishes a fresh batch id into the same table, so
the Delta table grows as a real one does.

Instances run one after the other here (in a batch they are parallel Spark tasks): the
time is the sum of stage + publish, the same for both sinks. The engines alternate,
``--repeat N`` times, best of N kept; CPU-s is this process's CPU time. Target:
Delta / Parquet ≤ 1.2.

    .venv/bin/python bench/bench_delta.py [--rows 1000000 | --quick] [--repeat 3] [--local]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import pyarrow as pa
from benchlib import print_table

from microbatch.checkpoint import Layout
from microbatch.settings import Settings
from microbatch.sinks import DeltaSink, ParquetSink, PublishContext, StageContext
from microbatch.storage import open_store

SCHEMA = pa.schema(
    [("user", pa.string()), ("page", pa.string()), ("ts", pa.int64()),
     ("clicks", pa.int64()), ("total", pa.int64())]
)  # fmt: skip
INSTANCES = 2


def make_rows(n: int) -> list[list[dict[str, Any]]]:
    """The batch's output rows, per instance (users split by parity, as key-groups would)."""
    per: list[list[dict[str, Any]]] = [[] for _ in range(INSTANCES)]
    for i in range(n):
        u = i % 10_000
        row = {"user": f"user-{u}", "page": f"/p{i % 50}", "ts": 1_767_225_600_000 + i,
               "clicks": 1 + i % 7, "total": i}  # fmt: skip
        per[u % INSTANCES].append(row)
    return per


def publish_batch(sink: Any, settings: Settings, ck: Any, batch_id: int, rows: list) -> dict:
    """stage() per instance then publish(), as the runtime calls them; seconds of each."""
    t0, c0 = time.perf_counter(), time.process_time()
    staged = []
    for i, part in enumerate(rows):
        ctx = StageContext("bench", batch_id, i, settings, ck, Layout(), uuid.uuid4().hex[:12])
        staged.append(sink.stage(ctx, part))
    t1 = time.perf_counter()
    ends = {"clicks:0": (batch_id + 1) * 1000}
    sink.publish(PublishContext("bench", batch_id, settings, ck, Layout(), tuple(staged), ends))
    t2, c2 = time.perf_counter(), time.process_time()
    return {"stage": t1 - t0, "publish": t2 - t1, "total": t2 - t0, "cpu": c2 - c0}


def run(args: argparse.Namespace, settings: Settings, root: str) -> None:
    rows = make_rows(args.rows)
    sinks = {
        "parquet": ParquetSink("out", f"{root}/parquet", SCHEMA),
        "delta": DeltaSink("out", f"{root}/delta", SCHEMA),
    }
    ck = open_store(f"{root}/checkpoints", settings)
    best: dict[str, dict] = {}
    for batch_id in range(args.repeat + 1):  # batch 0: warm-up (imports, table creation)
        for name, sink in sinks.items():
            result = publish_batch(sink, settings, ck, batch_id, rows)
            load = os.getloadavg()[0]
            print(f"  batch {batch_id} {name:8s} stage {result['stage']:.2f} s  publish "
                  f"{result['publish']:.3f} s  total {result['total']:.2f} s  "
                  f"cpu {result['cpu']:.2f} s  (load {load:.1f})")  # fmt: skip
            if batch_id and (name not in best or result["total"] < best[name]["total"]):
                best[name] = result
    p, d = best["parquet"], best["delta"]
    ratio = d["total"] / p["total"]
    print_table(
        [
            ("rows per batch", f"{args.rows:,}", f"{INSTANCES} instances, {root.split(':')[0]}"),
            ("parquet stage+publish", f"{p['total']:.2f} s",
             f"stage {p['stage']:.2f} s, publish {p['publish']:.3f} s, cpu {p['cpu']:.2f} s"),
            ("delta stage+publish", f"{d['total']:.2f} s",
             f"stage {d['stage']:.2f} s, publish {d['publish']:.3f} s, cpu {d['cpu']:.2f} s"),
            ("delta / parquet", f"{ratio:.3f}", "target <= 1.2 (best of "
             f"{args.repeat}; load {os.getloadavg()[0]:.1f}/{os.cpu_count()} cpus)"),
            ("delta / parquet CPU-s", f"{d['cpu'] / p['cpu']:.3f}", "of the same best runs"),
        ]
    )  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--quick", action="store_true", help="100k rows, 1 repeat")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--local", action="store_true", help="a local folder instead of S3")
    args = parser.parse_args()
    if args.quick:
        args.rows, args.repeat = 100_000, 1
    home = os.environ.get("MICROBATCH_HOME", str(Path(__file__).resolve().parents[1] / ".local"))
    with tempfile.TemporaryDirectory() as tmp:
        if args.local:
            run(args, Settings.from_env(home=home), tmp)
            return
        if "MICROBATCH_S3_ENDPOINT_URL" in os.environ:
            settings = Settings.from_env(home=home)
            run(args, settings, f"s3://{settings.s3_bucket}/bench-delta-{uuid.uuid4().hex[:8]}")
            return
        from microbatch.localstack import SeaweedFS
        from microbatch.localstack.process import free_port_block
        from microbatch.localstack.seaweedfs import ALL_OFFSETS

        port = free_port_block(ALL_OFFSETS)
        settings = Settings.from_env(home=home, s3_endpoint_url=f"http://127.0.0.1:{port}")
        seaweed = SeaweedFS(settings, Path(tmp) / "seaweedfs")
        seaweed.start()
        try:
            run(args, settings, f"s3://{settings.s3_bucket}/bench-delta")
        finally:
            seaweed.stop()


if __name__ == "__main__":
    main()
