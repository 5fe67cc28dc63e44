"""A kill soak (opt-in: ``MICROBATCH_SOAK_ROUNDS=N``, N rounds): ``microbatch run``
processes at random parallelism, SIGKILLed at random moments, while clicks keep arriving;
each next run just starts (the killed run's lease expires on its own). At the end the
Parquet output followed through its commits, the Delta and Iceberg tables, the PostgreSQL
upserts and appends, and the Kafka output read ``read_committed`` all equal a plain-Python count of
every click: nothing lost, nothing doubled.

Not part of ``make test`` (minutes per run); the closing notes quote its result.
"""

from __future__ import annotations

import collections
import json
import os
import random
import signal
import time
from pathlib import Path

import psycopg
import pytest

from microbatch.localstack.topics import read_topic
from microbatch.runtime import BatchOptions, BatchRunner
from microbatch.sinks import read_parquet_sink
from microbatch.sinks.delta import read_delta_sink
from microbatch.sinks.iceberg import read_iceberg_sink
from tests.integration.runtime.test_batches import clicks, new_topic, produce, totals
from tests.integration.runtime.test_zombies import REPO, start_batch

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("pyiceberg_threads")]

ROUNDS = int(os.environ.get("MICROBATCH_SOAK_ROUNDS", "0"))
JOB = """
import dataclasses
from tests.integration.runtime.pipelines import count_pipeline

pipeline = dataclasses.replace(
    count_pipeline({topic!r}, {root!r}, out_topic={out!r}, max_records_per_batch=60,
                   parallelism={parallelism}, delta={delta!r}, postgres=({dsn!r}, {prefix!r}),
                   iceberg={iceberg!r}),
    lease_timeout_s=2.0,
)
"""


@pytest.mark.skipif(ROUNDS == 0, reason="the kill soak runs with MICROBATCH_SOAK_ROUNDS=N")
def test_random_kills_lose_and_double_nothing(
    spark, kafka_settings, bootstrap, admin, postgres_dsn, tmp_path
):
    rng = random.Random(int(os.environ.get("MICROBATCH_SOAK_SEED", "7")))
    topic, out = new_topic(admin, 3), new_topic(admin, 2)
    prefix = f"soak_{topic.replace('-', '_')}"
    values: list[bytes] = []
    kills = finished = 0
    for round_ in range(ROUNDS):
        batch = clicks(rng.randint(20, 120), seed=round_)
        produce(bootstrap, topic, batch)
        values += batch
        job = tmp_path / f"job{round_}.py"
        job.write_text(
            JOB.format(
                topic=topic,
                root=str(tmp_path),
                out=out,
                parallelism=rng.randint(1, 4),
                delta=str(tmp_path / "delta"),
                iceberg=str(tmp_path / "iceberg"),
                dsn=postgres_dsn,
                prefix=prefix,
            )
        )
        proc = start_batch(kafka_settings, job, f"soak-{round_}", pause_at="")
        deadline = time.monotonic() + rng.uniform(1.0, 25.0)
        while proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            kills += 1
            time.sleep(2.2)  # its lease expires: the next run proceeds
        elif proc.returncode == 0:
            finished += 1
        proc.communicate()

    last = tmp_path / f"job{ROUNDS - 1}.py"
    pipeline = _load(last)
    time.sleep(2.5)  # the last killed run's lease expires
    while True:
        result = BatchRunner(spark, pipeline, kafka_settings).run(BatchOptions(run_id="drain"))
        if result.records_in == 0 and not any(result.lag.values()):
            break

    want = totals(values)
    parquet: collections.Counter[str] = collections.Counter()
    rows = read_parquet_sink(str(tmp_path / "counts")).to_pylist()
    for row in rows:
        parquet[row["user"]] += row["clicks"]
    kafka = [json.loads(m.value) for m in read_topic(bootstrap, out)]
    delta = read_delta_sink(str(tmp_path / "delta")).to_pylist()
    iceberg = read_iceberg_sink(pipeline.sink("counts_iceberg")).to_pylist()
    with psycopg.connect(postgres_dsn) as conn:
        upserted = dict(conn.execute(f'SELECT "user", total FROM {prefix}_totals').fetchall())
        log = conn.execute(f'SELECT "user", clicks, total FROM {prefix}_log').fetchall()
    print(f"soak: {ROUNDS} rounds, {kills} SIGKILLs, {finished} finished, {len(values)} clicks")
    assert dict(parquet) == want
    assert sorted(kafka, key=_row_key) == sorted(rows, key=_row_key)
    assert sorted(delta, key=_row_key) == sorted(rows, key=_row_key)
    assert sorted(iceberg, key=_row_key) == sorted(rows, key=_row_key)
    assert upserted == want
    assert sorted(log) == sorted((r["user"], r["clicks"], r["total"]) for r in rows)


def _row_key(row: dict) -> tuple:
    return (row["user"], row["total"])


def _load(job: Path):
    import sys

    from microbatch.jobfile import load_pipeline

    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    return load_pipeline(str(job))
