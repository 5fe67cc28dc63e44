"""The PostgreSQL sink against a raw ``COPY``, and the Iceberg sink against the Parquet sink.

One batch of ``--rows`` session rows of the clickstream's shape (``user_id``,
``session_start``, ``session_end``, ``clicks``, ``pages`` (a list of strings), ``segment``;
key ``(user_id, session_start)``), split over 2 instances as stage 2 hands them to a sink,
goes to a PostgreSQL server of the local stack (started on a free loopback port, fsync on)
four ways, rotated over ``--rounds`` rounds:

- **copy**: the reference — the rows as CSV (pyarrow), one ``COPY`` into a table with no
  index, one transaction: what a hand-written loader does, with no exactly-once at all;
  also **copy (sliced)**, the same sent in 50k-row slices as the sink sends them (the
  server inserts one slice while the next is encoded), for a stricter comparison;
- **upsert (new keys)**: ``PostgresSink(mode="upsert")``'s publish into an empty table
  (one COPY straight into it, the commit row);
- **upsert (all keys again)**: the same rows as the next batch: every row an update (a
  sample of the keys is found in the table, so COPY to a temporary table, then
  ``INSERT ... ON CONFLICT DO UPDATE``);
- **append**: ``mode="append"``'s publish (COPY into the table, its batch index, the
  commit row).

Publish reads the staged Parquet files from a local checkpoint folder as the runtime does;
staging (Arrow → Parquet per instance, in Spark tasks) is timed apart. Reported: median
and best rows/s of each, and the ratio of medians to the reference. Target:
upsert (new keys) / copy >= 0.5.

**Iceberg**: the same batch, as records per instance (what stage 2 hands a sink), through
``ParquetSink`` and ``IcebergSink`` (an embedded SQLite catalog, a local warehouse), stage
of every instance then publish, as the runtime calls them, each round a new batch into the
same table (it grows as a real one does); rotated, medians and bests. Target: Iceberg /
Parquet <= 1.2.

    .venv/bin/python bench/bench_sinks.py [--rows 1000000 | --quick] [--rounds 3]
                                          [--only postgres|iceberg]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import psycopg
import pyarrow as pa
from benchlib import print_table

from microbatch.checkpoint import Layout
from microbatch.localstack.postgres import PostgresServer
from microbatch.localstack.process import free_port_block
from microbatch.settings import Settings
from microbatch.sinks import PostgresSink, PublishContext, StageContext
from microbatch.sinks.postgres_rows import csv_bytes
from microbatch.storage import open_store

SCHEMA = pa.schema(
    [pa.field("user_id", pa.string(), nullable=False),
     pa.field("session_start", pa.int64(), nullable=False),
     ("session_end", pa.int64()), ("clicks", pa.int64()),
     ("pages", pa.list_(pa.string())), ("segment", pa.string())]
)  # fmt: skip
KEY = ("user_id", "session_start")
INSTANCES = 2


def make_rows(n: int) -> list[pa.Table]:
    """The batch's session rows per instance (users split by parity, as key-groups would)."""
    users = [i % 100_000 for i in range(n)]
    start = [1_767_225_600_000 + i * 10 for i in range(n)]
    table = pa.table(
        {
            "user_id": [f"user-{u}" for u in users],
            "session_start": start,
            "session_end": [s + 60_000 for s in start],
            "clicks": [1 + i % 9 for i in range(n)],
            "pages": [[f"/p{(i + j) % 50}" for j in range(1 + i % 4)] for i in range(n)],
            "segment": [("free", "pro", "team")[u % 3] for u in users],
        },
        schema=SCHEMA,
    )
    parity = pa.array([u % INSTANCES for u in users])
    return [table.filter(pa.compute.equal(parity, k)) for k in range(INSTANCES)]


def raw_copy(dsn: str, table: str, parts: list[pa.Table], slices: bool = False) -> None:
    """The reference: CREATE TABLE (no index) and COPY, one transaction; each instance's
    rows as one CSV buffer, or (``slices``) in 50k-row slices as the sink sends them."""
    if slices:
        parts = [pa.Table.from_batches([b]) for p in parts for b in p.to_batches(50_000)]
    with psycopg.connect(dsn) as conn:
        cols = ", ".join(SCHEMA.names)
        conn.execute(
            f"CREATE TABLE {table} (user_id text, session_start bigint, session_end bigint, "
            "clicks bigint, pages text[], segment text)"
        )
        with conn.cursor().copy(f"COPY {table} ({cols}) FROM STDIN (FORMAT csv)") as copy:
            for part in parts:
                copy.write(csv_bytes(part))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="100k rows, 3 rounds")
    parser.add_argument("--only", choices=("postgres", "iceberg"))
    args = parser.parse_args()
    if args.quick:
        args.rows = 100_000
    print(f"building {args.rows:,} rows ...", flush=True)
    parts = make_rows(args.rows)
    with tempfile.TemporaryDirectory(prefix="bench-sinks-") as tmp:
        os.chmod(tmp, 0o755)  # the server runs as the postgres account when we are root
        if args.only != "iceberg":
            server = PostgresServer(free_port_block([0]), Path(tmp) / "pg")
            server.start()
            try:
                run(args, parts, server.dsn(), Path(tmp) / "checkpoints")
            finally:
                server.stop()
        if args.only != "postgres":
            run_iceberg(args, parts, Path(tmp) / "lake")


def run_iceberg(args: argparse.Namespace, parts: list[pa.Table], root: Path) -> None:
    from microbatch.sinks import IcebergCatalog, IcebergSink, ParquetSink

    settings = Settings.from_env()
    ck = open_store(str(root / "checkpoints"), settings)
    catalog = IcebergCatalog.sql(f"sqlite:///{root / 'catalog.db'}", (root / "wh").as_uri())
    sinks = {
        "parquet": ParquetSink("s", str(root / "parquet"), SCHEMA),
        "iceberg": IcebergSink("s", "bench.sessions", SCHEMA, catalog=catalog),
    }
    records = [p.to_pylist() for p in parts]  # what stage 2 hands a sink
    batch = iter(range(10**6))
    times: dict[str, list[float]] = {name: [] for name in sinks}

    def one_batch(name: str) -> float:
        sink, batch_id, attempt = sinks[name], next(batch), uuid.uuid4().hex[:8]
        # The batch's plan, as the runtime stores it first: the Parquet sink checks that
        # its batch is still retained after staging a part (a stalled attempt's is not).
        ck.put(Layout().plan_key(batch_id), b"{}")
        t0 = time.perf_counter()
        staged = tuple(
            sink.stage(StageContext("bench", batch_id, i, settings, ck, Layout(), attempt), rows)
            for i, rows in enumerate(records)
        )
        ends = {"sessions:0": batch_id + 1}
        sink.publish(PublishContext("bench", batch_id, settings, ck, Layout(), staged, ends))
        return time.perf_counter() - t0

    for name in sinks:  # warm-up: imports, the catalog, the table's creation
        one_batch(name)
    names = list(sinks)
    for r in range(args.rounds):
        for name in names[r % 2 :] + names[: r % 2]:
            times[name].append(one_batch(name))
        shown = ", ".join(f"{n} {times[n][-1]:.2f} s" for n in names)
        print(f"  round {r + 1}: {shown}  (load {os.getloadavg()[0]:.1f})", flush=True)
    n = args.rows
    med = {name: statistics.median(t) for name, t in times.items()}
    rows = [("rows per batch", f"{n:,}", f"{INSTANCES} instances, records, {args.rounds} rounds")]
    for name in names:
        rows.append(
            (
                f"{name} stage+publish",
                f"{n / med[name]:,.0f} rows/s",
                f"median {med[name]:.2f} s, best {min(times[name]):.2f} s",
            )
        )
    rows.append(
        (
            "iceberg / parquet",
            f"{med['iceberg'] / med['parquet']:.3f}",
            f"target <= 1.2 (ratio of medians; load {os.getloadavg()[0]:.1f}/"
            f"{os.cpu_count()} cpus)",
        )
    )
    print_table(rows)
    from pyiceberg.utils.concurrent import ExecutorFactory

    if ExecutorFactory._instance is not None:  # its idle workers would hold the exit
        ExecutorFactory._instance.shutdown(wait=True)


def run(args: argparse.Namespace, parts: list[pa.Table], dsn: str, ck_dir: Path) -> None:
    settings = Settings.from_env()
    ck = open_store(str(ck_dir), settings)
    batch = iter(range(10**6))

    def stage(sink: PostgresSink) -> tuple[int, tuple, float]:
        batch_id, attempt = next(batch), uuid.uuid4().hex[:8]
        t0 = time.perf_counter()
        staged = tuple(
            sink.stage_table(StageContext("bench", batch_id, i, settings, ck, Layout(), attempt), p)
            for i, p in enumerate(parts)
        )
        return batch_id, staged, time.perf_counter() - t0

    def publish(sink: PostgresSink, batch_id: int, staged: tuple) -> None:
        ends = {"sessions:0": batch_id + 1}
        sink.publish(PublishContext("bench", batch_id, settings, ck, Layout(), staged, ends))

    def upsert_twice(name: str) -> dict[str, float]:
        sink = PostgresSink("s", name, SCHEMA, key=KEY, dsn=dsn)
        out = {}
        for label in ("upsert (new keys)", "upsert (all keys again)"):
            batch_id, staged, staging = stage(sink)
            t0 = time.perf_counter()
            publish(sink, batch_id, staged)
            out[label] = time.perf_counter() - t0
            out[f"{label} staging"] = staging
        return out

    def append(name: str) -> dict[str, float]:
        sink = PostgresSink("s", name, SCHEMA, mode="append", dsn=dsn)
        batch_id, staged, staging = stage(sink)
        t0 = time.perf_counter()
        publish(sink, batch_id, staged)
        return {"append": time.perf_counter() - t0, "append staging": staging}

    def copy(name: str) -> dict[str, float]:
        t0 = time.perf_counter()
        raw_copy(dsn, name, parts)
        t1 = time.perf_counter()
        raw_copy(dsn, name + "_sliced", parts, slices=True)
        return {"copy": t1 - t0, "copy (sliced)": time.perf_counter() - t1}

    engines: list[Callable[[str], dict[str, float]]] = [copy, upsert_twice, append]
    times: dict[str, list[float]] = {}
    copy(f"warmup_{uuid.uuid4().hex[:6]}")  # the server's caches, the imports
    for r in range(args.rounds):
        order = engines[r % len(engines) :] + engines[: r % len(engines)]
        for engine in order:
            got = engine(f"t_{engine.__name__}_{r}")
            for label, seconds in got.items():
                times.setdefault(label, []).append(seconds)
            shown = ", ".join(f"{k} {v:.2f} s" for k, v in got.items() if "staging" not in k)
            print(f"  round {r + 1}: {shown}  (load {os.getloadavg()[0]:.1f})", flush=True)
    n = args.rows
    ref = statistics.median(times["copy"])
    rows = [("rows per batch", f"{n:,}", f"{INSTANCES} instances, {args.rounds} rounds")]
    for label in (
        "copy",
        "copy (sliced)",
        "upsert (new keys)",
        "upsert (all keys again)",
        "append",
    ):
        med, best = statistics.median(times[label]), min(times[label])
        ratio = "reference" if label == "copy" else f"{ref / med:.2f} of copy's rows/s"
        rows.append(
            (label, f"{n / med:,.0f} rows/s", f"median {med:.2f} s, best {best:.2f} s; {ratio}")
        )
    staging = statistics.median(times["upsert (new keys) staging"])
    rows.append(("staging (Parquet)", f"{n / staging:,.0f} rows/s", "median, in stage-2 tasks"))
    sliced = statistics.median(times["copy (sliced)"])
    rows.append(
        (
            "upsert (new keys) / copy (sliced)",
            f"{sliced / statistics.median(times['upsert (new keys)']):.3f}",
            "the reference sending slices as the sink does",
        )
    )
    rows.append(
        (
            "upsert (new keys) / copy",
            f"{ref / statistics.median(times['upsert (new keys)']):.3f}",
            f"target >= 0.5 (ratio of medians; load {os.getloadavg()[0]:.1f}/"
            f"{os.cpu_count()} cpus)",
        )
    )
    print_table(rows)


if __name__ == "__main__":
    main()
