"""The same job code runs through a warm Spark Connect server with identical output."""

from __future__ import annotations

import dataclasses
import uuid
from pathlib import Path

import pyarrow.dataset as ds
import pyarrow.fs as pafs
import pytest

from microbatch.runner import run_job
from tests.integration.cluster.clickstream_runs import compare_with_reference

pytestmark = pytest.mark.integration
SMOKE_JOB = Path(__file__).resolve().parents[3] / "jobs" / "smoke.py"


@pytest.fixture(scope="module")
def connect_server(spark_connect):
    """The run's Connect server (``tests/conftest.py``), shared with the e2e tests."""
    return spark_connect


def _rows(settings, run_id: str) -> list[dict]:
    fs = pafs.S3FileSystem(**settings.pyarrow_s3_kwargs())
    table = ds.dataset(f"{settings.s3_bucket}/smoke/{run_id}", filesystem=fs).to_table()
    return sorted(table.to_pylist(), key=lambda r: (r["partition"], r["offset"]))


def test_connect_run_writes_exactly_the_rows_of_a_classic_run(connect_server, stack_settings):
    topic = f"smoke-connect-{uuid.uuid4().hex[:6]}"
    classic = dataclasses.replace(stack_settings, spark_master="local[2]")
    warm = dataclasses.replace(stack_settings, spark_master=connect_server.url)
    lines: list[str] = []

    first = run_job(SMOKE_JOB, ["--events", "1500", "--topic", topic, "--run-id", topic + "-a"],
                    classic)  # fmt: skip
    second = run_job(
        SMOKE_JOB,
        ["--no-produce", "--topic", topic, "--run-id", topic + "-b"],
        warm,
        lines.append,
    )

    assert "spark-submit" not in lines[0], "warm mode must not start a JVM with spark-submit"
    assert first["records_read"] == second["records_read"] == 1500
    assert _rows(warm, topic + "-b") == _rows(classic, topic + "-a")


def test_example_pipeline_through_connect_equals_classic_spark(
    connect_server, stack_settings, spark, profiles, monkeypatch
):
    warm = dataclasses.replace(stack_settings, spark_master=connect_server.url)
    run = compare_with_reference(spark, stack_settings, warm, profiles.url, monkeypatch)

    assert "spark-submit" not in run.first_log[0], "Connect must not start a JVM"
    assert [r["parallelism"] for r in run.results] == [2, 3]
    assert all(r["records_in"] > 0 for r in run.results)
    assert len(run.want["sessions"]) > 20
    assert run.got == run.want


SESSION_PROBE = """
import sys
from microbatch.settings import Settings
from microbatch.spark import spark_session

def worker_pid(batches):
    import os

    import pyarrow as pa

    for _ in batches:
        yield pa.RecordBatch.from_pydict({"pid": [os.getpid()]})


spark = spark_session(Settings.from_env(), app_name="microbatch-session-probe")
worker = spark.range(0, 1, 1, 1).mapInArrow(worker_pid, "pid long").collect()[0]["pid"]
print(spark.client._session_id, worker)
if sys.argv[1:] == ["stop"]:
    spark.stop()  # releases the session on the server: the next batch cannot join it
"""


def test_connect_batches_of_one_pipeline_share_a_session_and_its_python_workers(
    connect_server, stack_settings, tmp_path
):
    import os
    import subprocess
    import sys

    probe = tmp_path / "probe.py"
    probe.write_text(SESSION_PROBE)
    env = {**os.environ, **dataclasses.replace(stack_settings, spark_master=connect_server.url)
           .to_env()}  # fmt: skip

    def client(*args: str) -> tuple[str, str]:
        done = subprocess.run([sys.executable, str(probe), *args], env=env, capture_output=True,
                              text=True, check=True)  # fmt: skip
        session, worker = done.stdout.split()[-2:]
        return session, worker

    first, second, third = client(), client("stop"), client()

    assert first == second, "a second client process must join the same session and workers"
    assert third[0] != first[0], "a closed session is skipped for the next id of the day"
