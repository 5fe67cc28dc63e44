"""A job runs unchanged on a real Spark standalone cluster (master + 2 workers)."""

from __future__ import annotations

import dataclasses
import uuid
from pathlib import Path

import pytest

from microbatch.localstack.process import free_port_block
from microbatch.localstack.spark_cluster import SparkStandaloneCluster
from microbatch.runner import run_job

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


@pytest.fixture(scope="module")
def profiles(tmp_path_factory):
    from microbatch.demo import ProfileService

    service = ProfileService(5, 0.05, tmp_path_factory.mktemp("profiles") / "service.log")
    yield service
    service.stop()


def test_example_pipeline_on_two_workers_equals_local_mode_across_a_rescale(
    cluster, stack_settings, spark, profiles, monkeypatch
):
    from tests.integration.cluster import clickstream_runs as runs

    on_cluster = dataclasses.replace(stack_settings, spark_master=cluster.url)
    data = runs.new_data(stack_settings)
    local_cfg = runs.config(stack_settings, data, profiles.url, "local")
    cluster_cfg = runs.config(stack_settings, data, profiles.url, "cluster")

    runs.reference_batch(spark, stack_settings, local_cfg, 0, parallelism=2)
    first, lines = runs.job_batch(on_cluster, cluster_cfg, 0, 2, monkeypatch)
    runs.produce_second_half(stack_settings, data)
    runs.reference_batch(spark, stack_settings, local_cfg, 1, parallelism=3)
    second, _ = runs.job_batch(on_cluster, cluster_cfg, 1, 3, monkeypatch)

    assert any(cluster.url in line for line in lines), "the batch was not submitted to the cluster"
    assert first["records_in"] > 0 and second["records_in"] > 0
    assert (first["parallelism"], second["parallelism"]) == (2, 3)
    want, got = runs.outcome(stack_settings, local_cfg), runs.outcome(stack_settings, cluster_cfg)
    assert len(want["sessions"]) > 20
    assert got == want
