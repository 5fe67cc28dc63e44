"""The same job code runs through a warm Spark Connect server with identical output."""

from __future__ import annotations

import dataclasses
import uuid
from pathlib import Path

import pyarrow.dataset as ds
import pyarrow.fs as pafs
import pytest

from microbatch.localstack.process import free_port_block
from microbatch.localstack.spark_connect import SparkConnectServer
from microbatch.runner import run_job
from tests.integration.cluster.clickstream_runs import compare_with_reference

pytestmark = pytest.mark.integration
SMOKE_JOB = Path(__file__).resolve().parents[3] / "jobs" / "smoke.py"


@pytest.fixture(scope="module")
def connect_server(tmp_path_factory):
    server = SparkConnectServer(
        free_port_block([0]), tmp_path_factory.mktemp("connect"), "local[2]"
    )
    server.start()
    yield server
    server.stop()


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
