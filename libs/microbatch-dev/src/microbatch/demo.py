"""``make demo``: the clickstream pipeline end to end, with a rescale and a killed batch.

1. Start Kafka, SeaweedFS and PostgreSQL (unless running or external) and the profile
   service.
2. Produce a realistic clickstream (some malformed clicks), run batch 0 at parallelism 2.
3. Produce more clicks (some of them late), run batch 1 at parallelism 3 in a separate
   process and **kill it** (SIGKILL) mid-way; rerun it.
4. Once the partitions are idle, run a last batch: the watermark passes every session.
5. Print a summary and an exactly-once check: the sessions in Parquet, in the Delta table
   (read with deltalake), in the Kafka topic (``read_committed``), in the PostgreSQL table
   (psycopg) and in the Iceberg table (pyiceberg) against a reference computed in plain
   Python from the produced clicks — no duplicate, no missing session.

Everything lives under a fresh namespace per run (topics ``clicks-<run>`` ...,
``s3://<bucket>/demo-<run>/``), so the demo can run any number of times. Services this
command started are stopped at the end; the full log is ``$MICROBATCH_HOME/demo.log``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from microbatch.errors import MicrobatchError
from microbatch.examples.clicks import MALFORMED, MINUTE_MS, T0, generate_clicks
from microbatch.examples.profile_service import ProfileService
from microbatch.localstack import LocalStack, PostgresServer, stop_on_sigterm
from microbatch.localstack.topics import create_topics, produce, read_topic
from microbatch.settings import Settings


def kill_batch_midway(
    job: Path, env: dict[str, str], store: Any, batch_id: int, log: Path, after_s: float
) -> str:
    """Run a batch in its own process and SIGKILL it once it has planned and started."""
    from microbatch.checkpoint import Layout

    cmd = [sys.executable, str(job), "--parallelism", "3", "--run-id", "demo-batch-1"]
    with log.open("a") as out:
        proc = subprocess.Popen(
            cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        deadline = time.monotonic() + 180
        while not store.exists(Layout().spec_key(batch_id)):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise MicrobatchError(f"the batch process ended before planning; see {log}")
            time.sleep(0.2)
        time.sleep(after_s)
        if proc.poll() is not None:
            return "the batch finished before the kill"
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    return f"killed (SIGKILL) {after_s:.0f} s after it planned batch {batch_id}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="microbatch-demo", description=__doc__.split("\n")[0])
    parser.add_argument("--users", type=int, default=300)
    parser.add_argument("--hours", type=float, default=8.0)
    parser.add_argument("--seed", type=int, default=11)
    parser.add_argument("--job", default="jobs/clickstream.py")
    args = parser.parse_args(argv)
    stop_on_sigterm()
    settings = Settings.from_env()
    home = settings.home_path
    home.mkdir(parents=True, exist_ok=True)
    log_path = home / "demo.log"
    log_path.write_text("")
    logging.basicConfig(filename=log_path, level=logging.INFO)
    stack = LocalStack(settings)
    external = {
        "kafka": "MICROBATCH_KAFKA_BOOTSTRAP_SERVERS" in os.environ,
        "seaweedfs": "MICROBATCH_S3_ENDPOINT_URL" in os.environ,
        "postgres": "MICROBATCH_POSTGRES_DSN" in os.environ,
    }
    started: list[str] = []
    profiles = None
    t0 = time.monotonic()
    try:
        for name in ("kafka", "seaweedfs", "postgres"):
            if external[name] or stack.services[name].process.pid() is not None:
                print(f"[stack] {name}: using the running/external service")
                continue
            print(f"[stack] starting {name} ...", flush=True)
            step = time.monotonic()
            stack.start(name)
            started.append(name)
            print(f"[stack] {name} ready in {time.monotonic() - step:.1f} s", flush=True)
        if not external["postgres"]:
            server = stack.services["postgres"]
            assert isinstance(server, PostgresServer)
            server.create_database("demo")
            settings = dataclasses.replace(settings, postgres_dsn=server.dsn("demo"))
        profiles = ProfileService(latency_ms=10, error_rate=0.05, log=log_path)
        print(f"[profiles] profile service on {profiles.url} (10 ms latency, 5% errors)")
        return run_demo(args, settings, profiles, log_path, t0)
    except MicrobatchError as exc:
        print(f"\ndemo failed: {exc}\n(full log: {log_path})", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    finally:
        if profiles is not None:
            profiles.stop()
        for name in reversed(started):
            stack.stop(name)
            print(f"[stack] stopped {name}")


def run_demo(
    args: argparse.Namespace, settings: Settings, profiles: ProfileService, log: Path, t0: float
) -> int:
    from microbatch.examples.clickstream import (
        ClickstreamConfig,
        clickstream_pipeline,
        reference_sessions,
    )
    from microbatch.runtime import BatchOptions, BatchRunner
    from microbatch.sinks import read_delta_sink, read_iceberg_sink, read_parquet_sink
    from microbatch.spark import spark_session
    from microbatch.storage import open_store

    run = time.strftime("%Y%m%d-%H%M%S")
    config = ClickstreamConfig.fresh(
        settings.s3_bucket,
        "demo",
        run,
        profile_url=profiles.url,
        parallelism=2,
        idle_timeout_s=10.0,
        postgres_table=f"sessions_{run.replace('-', '_')}",
        iceberg_table=f"demo.sessions_{run.replace('-', '_')}",
    )
    pipeline = clickstream_pipeline(config)
    bootstrap = settings.kafka_bootstrap_servers
    create_topics(
        bootstrap, {config.topic: 3, config.sessions_topic: 2, config.dead_letter_topic: 1}
    )

    clicks = generate_clicks(args.users, args.hours, args.seed)
    half = T0 + int(args.hours * 30 * MINUTE_MS)
    phase1 = [c for c in clicks if c["ts"] < half]
    phase2 = [c for c in clicks if c["ts"] >= half]
    rng = random.Random(args.seed)
    late = [
        {**rng.choice(phase1), "ts": T0 + rng.randrange(0, 30 * MINUTE_MS), "page": "/late"}
        for _ in range(20)
    ]

    def encode(c: dict[str, Any]) -> tuple[bytes, bytes]:
        return c["user_id"].encode(), json.dumps(c).encode()

    produce(bootstrap, config.topic, [encode(c) for c in phase1] + [(None, m) for m in MALFORMED])
    print(f"[produce] {len(phase1):,} clicks + {len(MALFORMED)} malformed to {config.topic}")

    print(f"[spark] starting Spark ({settings.spark_master}) ...", flush=True)
    spark = spark_session(settings, app_name="microbatch-demo")
    results = []

    def run_batch(label: str, **options: Any) -> None:
        r = BatchRunner(spark, pipeline, settings).run(BatchOptions(**options)).to_json()
        results.append((label, r))
        print(
            f"[batch {r['batch_id']}] {label}: {r['records_in']:,} clicks in, "
            f"{r['outputs'].get('sessions', 0):,} sessions out, {r['dead_letters']} dead "
            f"letters, parallelism {r['parallelism']}, {r['seconds']['total']:.1f} s",
            flush=True,
        )

    run_batch("first batch", run_id="demo-batch-0")

    produce(bootstrap, config.topic, [encode(c) for c in phase2 + late])
    print(f"[produce] {len(phase2):,} clicks + {len(late)} late clicks to {config.topic}")
    env = {**os.environ, **settings.to_env(), **config.to_env()}
    store = open_store(pipeline.checkpoints, settings)
    print("[kill] running batch 1 at parallelism 3 in a separate process ...", flush=True)
    what = kill_batch_midway(Path(args.job), env, store, 1, log, after_s=4.0)
    print(f"[kill] {what}")
    run_batch("rerun of the killed batch", run_id="demo-batch-1", parallelism=3)

    time.sleep(config.idle_timeout_s + 1)  # partitions go idle: the watermark catches up
    run_batch("final batch (idle partitions)", run_id="demo-batch-2", parallelism=3)

    # The exactly-once check against plain Python.
    final_watermark = results[-1][1]["watermark"]
    expected = reference_sessions(phase1 + phase2, final_watermark)

    def key(r: dict[str, Any]) -> tuple[Any, ...]:
        return (r["user_id"], r["session_start"])

    parquet = sorted(read_parquet_sink(f"{config.root}/sessions", settings).to_pylist(), key=key)
    delta = sorted(read_delta_sink(f"{config.root}/sessions_delta", settings).to_pylist(), key=key)
    kafka = sorted(
        (json.loads(m.value) for m in read_topic(bootstrap, config.sessions_topic)), key=key
    )
    postgres = sorted(read_postgres(settings.postgres_dsn, config.postgres_table), key=key)
    iceberg_sink = next(s for s in pipeline.sinks if s.name == "sessions_iceberg")
    iceberg = sorted(read_iceberg_sink(iceberg_sink, settings).to_pylist(), key=key)
    dead = read_topic(bootstrap, config.dead_letter_topic)
    reasons: dict[str, int] = {}
    for m in dead:
        reason = dict(m.headers)["microbatch.reason"].decode()
        reasons[reason] = reasons.get(reason, 0) + 1

    def check(name: str, got: list[dict[str, Any]]) -> bool:
        keys = [key(r) for r in got]
        dupes = len(keys) - len(set(keys))
        missing = len({key(r) for r in expected} - set(keys))
        extra = len(set(keys) - {key(r) for r in expected})
        same = got == expected
        print(
            f"  {name:<22} {len(got):>6,} sessions  duplicates {dupes}  missing {missing}  "
            f"unexpected {extra}  {'identical to reference' if same else 'DIFFERENT'}"
        )
        return same and dupes == 0

    print("\n=== microbatch demo: clickstream sessionization ===")
    print(
        f"clicks produced   {len(clicks):,} valid + {len(late)} late + {len(MALFORMED)} malformed"
    )
    print(f"records in        {sum(r['records_in'] for _, r in results):,}")
    print(f"dead letters      {len(dead)} {reasons}")
    stats = profiles.stats()
    print(f"profile service   {stats['requests']:,} requests, {stats['errors']} errors (retried)")
    print("batches:")
    for label, r in results:
        s = r["seconds"]
        print(
            f"  batch {r['batch_id']}  P={r['parallelism']}  {r['records_in']:>6,} in  "
            f"{r['outputs'].get('sessions', 0):>5,} sessions  "
            f"spark job {s.get('execute', 0):.1f} s  total {s['total']:.1f} s  ({label})"
        )
    print(f"exactly-once check (reference: {len(expected):,} closed sessions, plain Python):")
    ok = check("Parquet (committed)", parquet) & check("Kafka (read_committed)", kafka)
    ok &= check("Delta (deltalake)", delta)
    ok &= check("PostgreSQL (psycopg)", postgres)
    ok &= check("Iceberg (pyiceberg)", iceberg)
    ok &= reasons.get("late", 0) == len(late)
    print(f"\n{'OK' if ok else 'MISMATCH'} in {time.monotonic() - t0:.0f} s  (log: {log})")
    return 0 if ok else 1


def read_postgres(dsn: str, table: str) -> list[dict[str, Any]]:
    """The PostgreSQL sink's rows, as the other sinks' readers give them."""
    import psycopg
    from psycopg.rows import dict_row

    columns = "user_id, session_start, session_end, clicks, pages, segment"
    with psycopg.connect(dsn, row_factory=dict_row) as conn:
        return conn.execute(f"SELECT {columns} FROM {table}").fetchall()


if __name__ == "__main__":
    sys.exit(main())
