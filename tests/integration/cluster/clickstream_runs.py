"""The example pipeline run two ways on the same data, for the cluster/Connect tests.

A *reference* run goes batch by batch in this process on the shared local SparkSession;
a *job* run submits ``jobs/clickstream.py`` with other Spark settings (a standalone
cluster, a Connect server). Both read the same topic at parallelism 2, then 3, and must
write the same sessions and hold the same state.
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from microbatch.checkpoint import Layout, latest_manifest
from microbatch.checkpoint.restore import restore_instance
from microbatch.examples.clicks import MALFORMED, T0, generate_clicks
from microbatch.examples.clickstream import ClickstreamConfig, clickstream_pipeline
from microbatch.localstack.topics import create_topics, produce
from microbatch.runner import run_job
from microbatch.runtime import BatchOptions, BatchRunner
from microbatch.settings import Settings
from microbatch.sinks import read_parquet_sink
from microbatch.storage import open_store

JOB = Path(__file__).resolve().parents[3] / "jobs" / "clickstream.py"


@dataclasses.dataclass
class Data:
    topic: str
    second_half: list[tuple[bytes, bytes]]


def new_data(settings: Settings) -> Data:
    topic = f"clicks-{uuid.uuid4().hex[:8]}"
    create_topics(settings.kafka_bootstrap_servers, {topic: 3})
    clicks = generate_clicks(users=30, hours=5, seed=9)
    half = T0 + int(2.5 * 3_600_000)

    def encode(c: dict[str, Any]) -> tuple[bytes, bytes]:
        return c["user_id"].encode(), json.dumps(c).encode()

    first = [encode(c) for c in clicks if c["ts"] < half] + [(None, m) for m in MALFORMED]
    produce(settings.kafka_bootstrap_servers, topic, first)
    return Data(topic, [encode(c) for c in clicks if c["ts"] >= half])


def config(settings: Settings, data: Data, profile_url: str, name: str) -> ClickstreamConfig:
    run = f"{name}-{uuid.uuid4().hex[:6]}"
    out = f"sessions-{run}"
    create_topics(settings.kafka_bootstrap_servers, {out: 1, f"dlq-{run}": 1})
    return ClickstreamConfig(
        topic=data.topic,
        sessions_topic=out,
        dead_letter_topic=f"dlq-{run}",
        root=f"s3://{settings.s3_bucket}/cluster-tests/{run}",
        profile_url=profile_url,
        idle_timeout_s=1e9,  # never idle: watermarks must not depend on wall-clock gaps
    )


def reference_batch(
    spark: Any, settings: Settings, cfg: ClickstreamConfig, n: int, parallelism: int
) -> dict[str, Any]:
    pipeline = clickstream_pipeline(cfg)
    options = BatchOptions(run_id=f"ref-{n}", parallelism=parallelism)
    return BatchRunner(spark, pipeline, settings).run(options).to_json()


def job_batch(
    settings: Settings, cfg: ClickstreamConfig, n: int, parallelism: int, monkeypatch: Any
) -> tuple[dict[str, Any], list[str]]:
    """One batch through ``jobs/clickstream.py``; (its result, its log lines)."""
    for name, value in cfg.to_env().items():
        monkeypatch.setenv(name, value)
    lines: list[str] = []
    args = ["--parallelism", str(parallelism), "--run-id", f"job-{n}"]
    result = run_job(JOB, args, settings, lines.append)
    return result, lines


def produce_second_half(settings: Settings, data: Data) -> None:
    produce(settings.kafka_bootstrap_servers, data.topic, data.second_half)


def outcome(settings: Settings, cfg: ClickstreamConfig) -> dict[str, Any]:
    sessions = read_parquet_sink(f"{cfg.root}/sessions", settings).to_pylist()
    store = open_store(f"{cfg.root}/checkpoints", settings)
    manifest = latest_manifest(store, Layout())
    backend, _ = restore_instance(store, manifest, 1, 0)
    return {
        "sessions": sorted(sessions, key=lambda r: (r["user_id"], r["session_start"])),
        "state": {kg: backend.export_rows(kg) for kg in range(manifest.max_parallelism)},
        "parallelism": manifest.parallelism,
        "checkpoint": manifest.checkpoint_id,
        "watermark": manifest.metadata["watermark"],
    }


@dataclasses.dataclass
class Comparison:
    """The job run's batch results and log, and both runs' outcomes."""

    results: list[dict[str, Any]]
    first_log: list[str]
    want: dict[str, Any]
    got: dict[str, Any]


def compare_with_reference(
    spark: Any, settings: Settings, job_settings: Settings, profile_url: str, monkeypatch: Any
) -> Comparison:
    """Batches at parallelism 2 then 3, in this process and as jobs with ``job_settings``.

    Each reference batch runs on a thread while its job batch runs: the two write to
    roots of their own and only read the topic, and the job spends most of its time
    waiting for its JVMs and executors to start."""
    data = new_data(settings)
    reference = config(settings, data, profile_url, "reference")
    job = config(settings, data, profile_url, "job")
    results, logs = [], []
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="reference") as pool:
        for n, parallelism in enumerate((2, 3)):
            if n == 1:
                produce_second_half(settings, data)
            ref = pool.submit(reference_batch, spark, settings, reference, n, parallelism)
            result, lines = job_batch(job_settings, job, n, parallelism, monkeypatch)
            ref.result()
            results.append(result)
            logs.append(lines)
    return Comparison(results, logs[0], outcome(settings, reference), outcome(settings, job))
