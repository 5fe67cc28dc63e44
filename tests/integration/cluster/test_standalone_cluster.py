"""A job runs unchanged on a real Spark standalone cluster (master + 2 workers)."""

from __future__ import annotations

import dataclasses
import uuid
from pathlib import Path

import pytest

from microbatch.localstack.process import free_port_block
from microbatch.localstack.spark_cluster import SparkStandaloneCluster
from microbatch.runner import run_job
from tests.integration.cluster.clickstream_runs import compare_with_reference

pytestmark = pytest.mark.integration
SMOKE_JOB = Path(__file__).resolve().parents[3] / "jobs" / "smoke.py"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    port = free_port_block([0, 1, 2, 3])
    spark = SparkStandaloneCluster(port, tmp_path_factory.mktemp("spark-cluster"), workers=2)
    spark.start()
    yield spark
    spark.stop()


def test_smoke_job_on_two_workers_writes_the_same_rows_as_produced(cluster, stack_settings):
    settings = dataclasses.replace(stack_settings, spark_master=cluster.url)
    run_id = f"cluster-{uuid.uuid4().hex[:6]}"
    lines: list[str] = []

    result = run_job(SMOKE_JOB, ["--events", "3000", "--run-id", run_id], settings, lines.append)

    assert result["produced"] == result["records_read"] == result["rows_in_parquet"] == 3000
    assert any(cluster.url in line for line in lines), "job was not submitted to the cluster"
    apps = list((cluster.workdir / "work").glob("app-*/*"))
    assert len(apps) >= 2, f"expected executors on both workers, found {apps}"


def test_example_pipeline_on_two_workers_equals_local_mode_across_a_rescale(
    cluster, stack_settings, spark, profiles, monkeypatch
):
    on_cluster = dataclasses.replace(stack_settings, spark_master=cluster.url)
    run = compare_with_reference(spark, stack_settings, on_cluster, profiles.url, monkeypatch)

    assert any(cluster.url in line for line in run.first_log), "not submitted to the cluster"
    assert [r["parallelism"] for r in run.results] == [2, 3]
    assert all(r["records_in"] > 0 for r in run.results)
    assert len(run.want["sessions"]) > 20
    assert run.got == run.want
