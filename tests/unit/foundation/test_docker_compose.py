"""docker-compose.yml cannot run here (no Docker engine), so its structure is pinned down."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from microbatch import Settings

COMPOSE = Path(__file__).resolve().parents[3] / "docker-compose.yml"
AIRFLOW_SERVICES = [
    "airflow-apiserver",
    "airflow-scheduler",
    "airflow-dag-processor",
    "airflow-triggerer",
]


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def test_compose_has_every_service_of_the_stack(compose):
    expected = {"kafka", "s3", "spark-master", "spark-worker", "postgres", "airflow-init"}

    assert expected | set(AIRFLOW_SERVICES) <= set(compose["services"])


def test_every_image_is_pinned_to_a_version(compose):
    for name, service in compose["services"].items():
        image = service["image"]
        tag = image.rpartition(":")[2] if ":" in image else ""
        assert re.match(r"\d+\.\d+", tag), f"service {name} uses unpinned image {image!r}"


def test_kafka_runs_kraft_with_transactions_on_one_node(compose):
    env = compose["services"]["kafka"]["environment"]

    assert compose["services"]["kafka"]["image"].startswith("apache/kafka:4.1")
    assert env["KAFKA_PROCESS_ROLES"] == "broker,controller"
    assert env["KAFKA_TRANSACTION_STATE_LOG_REPLICATION_FACTOR"] == 1
    assert "9092:9092" in compose["services"]["kafka"]["ports"]


def test_airflow_is_3_3_on_postgres_with_the_repo_folders_mounted(compose):
    for name in AIRFLOW_SERVICES:
        service = compose["services"][name]
        env = service["environment"]
        mounts = {volume.split(":")[1] for volume in service["volumes"]}
        assert service["image"].startswith("apache/airflow:3.3."), name
        assert env["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"].startswith("postgresql"), name
        assert {"/opt/microbatch/dags", "/opt/microbatch/plugins"} <= mounts, name
        assert {"/opt/microbatch/jobs", "/opt/microbatch/libs"} <= mounts, name
    assert "8080:8080" in compose["services"]["airflow-apiserver"]["ports"]


def test_spark_worker_joins_the_master(compose):
    worker = " ".join(compose["services"]["spark-worker"]["command"])

    assert "org.apache.spark.deploy.worker.Worker" in worker
    assert "spark://spark-master:7077" in worker


def test_microbatch_variables_match_the_settings_module(compose):
    known = set(Settings.env_names())
    for name, service in compose["services"].items():
        used = {key for key in service.get("environment", {}) if key.startswith("MICROBATCH_")}
        unknown = used - known
        assert not unknown, f"service {name} sets {unknown}, which settings.py does not read"
    for name in ["spark-master", "spark-worker", *AIRFLOW_SERVICES]:
        env = compose["services"][name]["environment"]
        assert known <= set(env), f"service {name} misses {known - set(env)}"
