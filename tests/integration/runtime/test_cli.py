"""The ``microbatch`` CLI against the real stack (in-process, sharing the test SparkSession)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from microbatch.cli import main
from tests.integration.runtime.test_batches import clicks, new_topic, produce

pytestmark = pytest.mark.integration

JOB = """
from tests.integration.runtime.pipelines import count_pipeline
pipeline = count_pipeline({topic!r}, {root!r}, max_records_per_batch=20)
"""


@pytest.fixture
def job(kafka_settings, tmp_path: Path, monkeypatch) -> tuple[Path, str]:
    from kafka import KafkaAdminClient

    admin = KafkaAdminClient(bootstrap_servers=kafka_settings.kafka_bootstrap_servers)
    try:
        topic = new_topic(admin, 2)
    finally:
        admin.close()
    produce(kafka_settings.kafka_bootstrap_servers, topic, clicks(30))
    for name, value in kafka_settings.to_env().items():
        monkeypatch.setenv(name, value)
    path = tmp_path / "job.py"
    path.write_text(JOB.format(topic=topic, root=str(tmp_path)))
    return path, topic


def test_cli_runs_batches_and_reports_status_checkpoints_and_state(spark, job, capsys) -> None:
    path, _topic = job
    assert main(["run", str(path), "--batches", "2", "--json"]) == 0
    runs = json.loads(capsys.readouterr().out)["batches"]
    assert [r["records_in"] for r in runs] == [20, 10]

    assert main(["status", str(path), "--json"]) == 0
    status = json.loads(capsys.readouterr().out)
    assert status["checkpoint"] == 1
    assert {p["lag"] for p in status["partitions"]} == {0}
    assert sum(p["committed"] for p in status["partitions"]) == 30

    assert main(["checkpoints", str(path)]) == 0
    listing = capsys.readouterr().out
    assert "checkpoint" in listing.splitlines()[0] and len(listing.splitlines()) == 4

    assert main(["state", str(path), "u1", "--json"]) == 0
    state = json.loads(capsys.readouterr().out)["state"]
    assert state["total"] == sum(1 for i in range(30) if (i * 5) % 7 == 1)

    assert main(["run", str(path), "--dry-run", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)["batches"][0]
    assert plan["status"] == "dry_run" and plan["ranges"] == []


def test_cli_names_a_bad_pipeline_reference_and_exits_1(tmp_path: Path, capsys) -> None:
    assert main(["status", str(tmp_path / "missing.py")]) == 1
    assert "missing.py' does not exist" in capsys.readouterr().err
    bad = tmp_path / "bad.py"
    bad.write_text("pipeline = 42\n")
    assert main(["status", str(bad)]) == 1
    assert "is not a microbatch Pipeline" in capsys.readouterr().err
