"""Freshness: how long after a record is produced a reader sees it, through Airflow.

The whole production shape on loopback: Kafka, SeaweedFS, PostgreSQL (Airflow's metadata
DB), a warm Spark Connect server, and ``airflow standalone`` (scheduler, triggerer, DAG
processor, LocalExecutor) running two DAGs of ``bench/freshness_job.py`` (every record out,
once, to Parquet), each on its own topic and sink:

- ``freshness_cron``: ``schedule="* * * * *"``, the tightest cron (a batch a minute);
- ``freshness_event``: ``schedule="on_new_data"``, the asset watcher polling every
  ``--poll`` seconds.

Per round, each DAG in turn (the order alternates) is unpaused while a producer sends
``--rate`` records/s for ``--minutes``; a reader polls the sink every 0.25 s, as a user's
reader would, and takes ``seen - produced`` for every row the moment its batch becomes
visible. Reported per mode: p50/p95/max over all rounds (median and best of the rounds'
p50s), the batch task's start → end (the job commits and publishes in it) per run, and the
ratio cron/event. Then a burst of ``--burst`` records at once for the event-driven DAG:
its run's batch task, start → end, against the target of 3 s.

Targets (issue 27): event-driven p50 ≤ 15 s; the warm run of a 1k-record batch ≤ 3 s from
task start to commit.

    .venv/bin/python bench/bench_freshness.py [--minutes 2] [--rounds 3] [--rate 20]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

from benchlib import load, log, print_table

from microbatch.localstack import KafkaBroker, PostgresServer, SeaweedFS, SparkConnectServer
from microbatch.localstack.airflow import AirflowStandalone
from microbatch.localstack.process import free_port_block
from microbatch.localstack.seaweedfs import ALL_OFFSETS
from microbatch.localstack.topics import create_topics
from microbatch.settings import Settings

REPO = Path(__file__).resolve().parents[1]
JOB = REPO / "bench" / "freshness_job.py"
CRON, EVENT = "freshness_cron", "freshness_event"
DAG_FILE = """
from microbatch_airflow.dag_factory import microbatch_dag

microbatch_dag({dag_id!r}, {job!r}, pipeline={dag_id!r}, schedule={schedule!r},
               new_data_poll_s={poll!r}, max_parallelism=16, default_parallelism=2,
               env={env!r}, retries=0)
"""


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class SinkReader:
    """Polls a Parquet sink the way a reader does; every row's latency when first seen."""

    def __init__(self, url: str, settings: Settings) -> None:
        from microbatch.storage import open_store

        self.store = open_store(url, settings)
        self.seen_batches: set[int] = set()
        self.latency_s: dict[int, float] = {}  # record id -> seen - produced
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> SinkReader:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        from microbatch.sinks import parquet as ps

        while not self._stop.wait(0.25):
            entries = ps.commit_entries(self.store)
            for batch in ps.visible_batches(entries):
                if batch in self.seen_batches:
                    continue
                now_ms = time.time() * 1000
                self.seen_batches.add(batch)
                for key in entries[batch]["files"]:
                    table = pq.read_table(pa.BufferReader(self.store.get(key)))
                    for row in table.select(["id", "produced_ms"]).to_pylist():
                        self.latency_s.setdefault(row["id"], (now_ms - row["produced_ms"]) / 1000)


def produce_steadily(bootstrap: str, topic: str, rate: float, seconds: float, first_id: int) -> int:
    """``rate`` records/s for ``seconds``; each record's value carries its produce time."""
    from kafka import KafkaProducer

    producer = KafkaProducer(bootstrap_servers=bootstrap, acks="all", linger_ms=0)
    sent, start = 0, time.monotonic()
    try:
        while time.monotonic() - start < seconds:
            now_ms = int(time.time() * 1000)
            i = first_id + sent
            value = {"id": i, "key": f"k{i % 50}", "produced_ms": now_ms}
            producer.send(topic, key=value["key"].encode(), value=json.dumps(value).encode(),
                          timestamp_ms=now_ms)  # fmt: skip
            sent += 1
            time.sleep(max(0.0, start + sent / rate - time.monotonic()))
        producer.flush()
    finally:
        producer.close()
    return sent


def wait_for(reader: SinkReader, ids: range, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not all(i in reader.latency_s for i in ids):
        if time.monotonic() > deadline:
            missing = sum(i not in reader.latency_s for i in ids)
            raise SystemExit(f"{missing} of {len(ids)} records not visible after {timeout:.0f} s")
        time.sleep(0.5)


class Bench:
    def __init__(self, airflow: AirflowStandalone, settings: Settings, roots: dict[str, str],
                 topics: dict[str, str]) -> None:  # fmt: skip
        self.airflow = airflow
        self.settings = settings
        self.roots = roots
        self.topics = topics
        self.token = airflow.token("admin")
        self.next_id = 0

    def api(self, method: str, path: str, body: Any = None) -> Any:
        return self.airflow.request(method, path, body, token=self.token)

    def set_paused(self, dag_id: str, paused: bool) -> None:
        self.airflow.wait_for_dag(dag_id, self.token)
        self.api("PATCH", f"/api/v2/dags/{dag_id}", {"is_paused": paused})

    def settle(self, dag_id: str, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        path = f"/api/v2/dags/{dag_id}/dagRuns?state=queued&state=running&limit=1"
        while self.api("GET", path)["total_entries"]:
            if time.monotonic() > deadline:
                raise SystemExit(f"{dag_id}: runs still active after {timeout:.0f} s")
            time.sleep(1)

    def batch_durations(self, dag_id: str, since: str) -> list[float]:
        """Start → end of every batch task that ran (not skipped) since ``since``."""
        path = (f"/api/v2/dags/{dag_id}/dagRuns/~/taskInstances?task_id=batch&state=success"
                f"&start_date_gte={quote(since)}&limit=200")  # fmt: skip
        out = []
        for ti in self.api("GET", path)["task_instances"]:
            start = _parse(ti["start_date"])
            out.append(_parse(ti["end_date"]) - start)
        return out

    def round(self, dag_id: str, rate: float, seconds: float) -> dict[str, Any]:
        from datetime import UTC, datetime

        since = datetime.now(UTC).isoformat()
        with SinkReader(f"{self.roots[dag_id]}/rows", self.settings) as reader:
            self.set_paused(dag_id, False)
            sent = produce_steadily(self.settings.kafka_bootstrap_servers, self.topics[dag_id],
                                    rate, seconds, self.next_id)  # fmt: skip
            ids = range(self.next_id, self.next_id + sent)
            self.next_id += sent
            wait_for(reader, ids, timeout=180)
        self.set_paused(dag_id, True)
        self.settle(dag_id)
        latencies = [reader.latency_s[i] for i in ids]
        return {"latency": latencies, "batches": self.batch_durations(dag_id, since)}

    def burst(self, n: int) -> tuple[float, list[float]]:
        """``n`` records at once into the event-driven DAG's topic: the batch task of the run
        that read them, start → end, and the rows' latencies."""
        from datetime import UTC, datetime

        from kafka import KafkaProducer

        since = datetime.now(UTC).isoformat()
        ids = range(self.next_id, self.next_id + n)
        self.next_id += n
        with SinkReader(f"{self.roots[EVENT]}/rows", self.settings) as reader:
            self.set_paused(EVENT, False)
            producer = KafkaProducer(bootstrap_servers=self.settings.kafka_bootstrap_servers,
                                     acks="all", linger_ms=20)  # fmt: skip
            now_ms = int(time.time() * 1000)
            for i in ids:
                value = {"id": i, "key": f"k{i % 50}", "produced_ms": now_ms}
                producer.send(self.topics[EVENT], key=value["key"].encode(),
                              value=json.dumps(value).encode(), timestamp_ms=now_ms)  # fmt: skip
            producer.flush()
            producer.close()
            wait_for(reader, ids, timeout=180)
        self.set_paused(EVENT, True)
        self.settle(EVENT)
        durations = self.batch_durations(EVENT, since)
        return max(durations) if durations else float("nan"), [reader.latency_s[i] for i in ids]


def _parse(text: str) -> float:
    from datetime import datetime

    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


@contextlib.contextmanager
def local_stack(work: Path) -> Iterator[tuple[Settings, PostgresServer, SparkConnectServer]]:
    kafka_port = free_port_block([0, 1])
    s3_port = free_port_block(ALL_OFFSETS)
    settings = Settings.from_env(
        kafka_bootstrap_servers=f"127.0.0.1:{kafka_port}",
        s3_endpoint_url=f"http://127.0.0.1:{s3_port}",
    )
    kafka = KafkaBroker(settings, work / "kafka")
    s3 = SeaweedFS(settings, work / "seaweedfs")
    pg_dir = Path(tempfile.mkdtemp(prefix="microbatch-bench-pg-"))
    postgres = PostgresServer(free_port_block([0]), pg_dir, durable=False)
    connect = SparkConnectServer(free_port_block([0]), work / "spark-connect", master="local[2]")
    started: list[Any] = []
    try:
        for name, service in (("Kafka", kafka), ("SeaweedFS", s3), ("PostgreSQL", postgres),
                              ("Spark Connect", connect)):  # fmt: skip
            log(f"starting {name} ...")
            service.start()
            started.append(service)
        yield settings, postgres, connect
    finally:
        for service in reversed(started):
            service.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=2.0, help="producing per mode and round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rate", type=float, default=20.0, help="records/s")
    parser.add_argument("--poll", type=float, default=1.0, help="the watcher's poll, s")
    parser.add_argument("--burst", type=int, default=1000)
    args = parser.parse_args()
    run = uuid.uuid4().hex[:6]
    with (
        tempfile.TemporaryDirectory(prefix="bench-freshness-") as tmp,
        local_stack(Path(tmp)) as (settings, postgres, connect),
    ):
        work = Path(tmp)
        topics = {CRON: f"fresh-cron-{run}", EVENT: f"fresh-event-{run}"}
        create_topics(settings.kafka_bootstrap_servers, {t: 2 for t in topics.values()})
        roots = {d: f"s3://{settings.s3_bucket}/bench-freshness-{run}/{d}" for d in topics}
        dags = work / "dags"
        dags.mkdir()
        for dag_id, schedule in ((CRON, "* * * * *"), (EVENT, "on_new_data")):
            env = {"MICROBATCH_FRESHNESS_TOPIC": topics[dag_id],
                   "MICROBATCH_FRESHNESS_ROOT": roots[dag_id]}  # fmt: skip
            text = DAG_FILE.format(dag_id=dag_id, job=str(JOB), schedule=schedule,
                                   poll=args.poll, env=env)  # fmt: skip
            (dags / f"{dag_id}.py").write_text(text)
        postgres.create_database("airflow")
        home = work / "airflow"
        env = dict(os.environ) | settings.to_env() | postgres.airflow_env("airflow") | {
            "MICROBATCH_SPARK_MASTER": connect.url,
            "AIRFLOW__CORE__DAGS_FOLDER": str(dags),
            "AIRFLOW__CORE__PLUGINS_FOLDER": str(REPO / "plugins"),
            "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
            "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": "admin:admin",
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
            "PYSPARK_PYTHON": sys.executable,
        }  # fmt: skip
        airflow = AirflowStandalone(home, None, env)
        log(f"starting airflow standalone (log: {airflow.log_path}) ...")
        airflow.start()
        try:
            bench = Bench(airflow, settings, roots, topics)
            results: dict[str, list[dict[str, Any]]] = {CRON: [], EVENT: []}
            for r in range(args.rounds):
                order = (EVENT, CRON) if r % 2 == 0 else (CRON, EVENT)
                for dag_id in order:
                    log(f"round {r + 1}/{args.rounds}: {dag_id}, {args.rate:g} records/s for "
                        f"{args.minutes:g} min ({load()})")  # fmt: skip
                    out = bench.round(dag_id, args.rate, args.minutes * 60)
                    p50 = statistics.median(out["latency"])
                    log(f"  p50 {p50:.1f} s over {len(out['latency'])} records, "
                        f"{len(out['batches'])} batches")  # fmt: skip
                    results[dag_id].append(out)
            log(f"burst of {args.burst} records into {EVENT} ({load()})")
            burst_s, burst_latency = bench.burst(args.burst)
        finally:
            airflow.stop()
    rows = []
    p50s = {}
    for dag_id, label in ((EVENT, "event-driven"), (CRON, "cron 1 min")):
        every = [x for o in results[dag_id] for x in o["latency"]]
        per_round = [statistics.median(o["latency"]) for o in results[dag_id]]
        batches = [x for o in results[dag_id] for x in o["batches"]]
        p50s[dag_id] = statistics.median(per_round)
        rows += [
            (f"{label}: produced → visible p50", f"{statistics.median(every):.1f} s",
             f"rounds' p50: median {p50s[dag_id]:.1f} s, best {min(per_round):.1f} s"),
            (f"{label}: p95 / max", f"{percentile(every, 0.95):.1f} s",
             f"max {max(every):.1f} s, {len(every)} records"),
            (f"{label}: batch task start → end p50", f"{statistics.median(batches):.1f} s",
             f"{len(batches)} batches, best {min(batches):.1f} s"),
        ]  # fmt: skip
    rows += [
        ("ratio cron / event-driven (p50)", f"{p50s[CRON] / p50s[EVENT]:.1f}x", ""),
        ("event-driven p50 target", "≤ 15 s", "met" if p50s[EVENT] <= 15 else "NOT met"),
        (f"burst {args.burst} records: batch task start → end", f"{burst_s:.1f} s",
         f"target ≤ 3 s: {'met' if burst_s <= 3 else 'NOT met'}; produced → visible p50 "
         f"{statistics.median(burst_latency):.1f} s"),
        ("load", load(), f"{args.rounds} rounds × {args.minutes:g} min per mode"),
    ]  # fmt: skip
    print_table(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
