"""The ``microbatch`` CLI against the real stack (in-process, sharing the test SparkSession)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from microbatch.cli import main
from microbatch.errors import ExitCode
from tests.integration.runtime.test_batches import clicks, new_topic, produce

REPO = Path(__file__).resolve().parents[3]

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
    assert all(r["watermark"] is None and r["watermark_iso"] is None for r in runs)  # no event time

    assert main(["status", str(path), "--json"]) == 0
    status = json.loads(capsys.readouterr().out)
    assert status["checkpoint"] == 1
    assert {p["lag"] for p in status["partitions"]} == {0}
    assert sum(p["committed"] for p in status["partitions"]) == 30
    assert isinstance(status["created_at"], int) and status["created_at_iso"].endswith("+00:00")
    assert status["lease"]["released"] and not status["lease"]["held"]
    assert status["stored_plan"] is None

    assert main(["checkpoints", str(path)]) == 0
    listing = capsys.readouterr().out
    assert "checkpoint" in listing.splitlines()[0] and len(listing.splitlines()) == 4

    assert main(["state", str(path), "u1", "--json"]) == 0
    state = json.loads(capsys.readouterr().out)["state"]
    assert state["total"] == sum(1 for i in range(30) if (i * 5) % 7 == 1)

    assert main(["state", str(path), "nobody", "--json"]) == ExitCode.NOT_FOUND == 6
    error = json.loads(capsys.readouterr().out)["error"]
    assert error["reason"] == "not_found" and "at checkpoint 1" in error["message"]

    assert main(["run", str(path), "--dry-run", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)["batches"][0]
    assert plan["status"] == "dry_run" and plan["ranges"] == []
    assert main(["status", str(path), "--json"]) == 0  # the dry run's plan, for the next run
    stored = json.loads(capsys.readouterr().out)["stored_plan"]
    assert (stored["batch_id"], stored["ranges"], stored["replayed_by_next_run"]) == (2, 0, True)


def test_cli_names_a_bad_pipeline_reference_and_exits_with_the_config_code(
    tmp_path: Path, capsys
) -> None:
    assert main(["status", str(tmp_path / "missing.py")]) == ExitCode.CONFIG_ERROR == 2
    assert "missing.py' does not exist" in capsys.readouterr().err
    bad = tmp_path / "bad.py"
    bad.write_text("pipeline = 42\n")
    assert main(["status", str(bad)]) == ExitCode.CONFIG_ERROR
    assert "is not a microbatch Pipeline" in capsys.readouterr().err


def test_a_cli_process_refused_by_a_held_lease_exits_3_and_says_who_holds_it(
    stack_settings, s3_settings, tmp_path: Path
) -> None:
    """The contract the Airflow operator relies on, across a real process boundary:
    another run holds the pipeline's lease on S3, so `microbatch run` exits 3."""
    from microbatch.runtime import fence
    from microbatch.storage import open_store

    root = f"s3://{s3_settings.s3_bucket}/cli-lease-{uuid.uuid4().hex[:8]}"
    job = tmp_path / "job.py"
    job.write_text(JOB.format(topic="clicks-never-read", root=root))
    env = {
        **os.environ,
        **stack_settings.to_env(),
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    cli = [str(Path(sys.executable).with_name("microbatch")), "run", str(job)]
    store = open_store(f"{root}/checkpoints", s3_settings)
    held = fence.acquire(store, "counts", "clickstream/scheduled__10:05", timeout_s=600)
    try:
        as_json = subprocess.run([*cli, "--json"], env=env, capture_output=True, text=True)
        plain = subprocess.run(cli, env=env, capture_output=True, text=True)
    finally:
        held.release()

    assert as_json.returncode == ExitCode.LEASE_HELD == 3, as_json.stderr
    error = json.loads(as_json.stdout)["error"]
    assert error["reason"] == "lease_held" and error["exit_code"] == 3
    assert "is being run by 'clickstream/scheduled__10:05'" in error["message"]
    assert plain.returncode == 3 and plain.stdout == ""
    last = plain.stderr.strip().splitlines()[-1]  # after the progress lines
    assert last.startswith("microbatch run: pipeline 'counts' is being run by")
    # Released: the same command now gets past the lease (and runs, or fails for another
    # reason — never the lease).
    after = subprocess.run([*cli, "--dry-run", "--json"], env=env, capture_output=True, text=True)
    assert after.returncode != ExitCode.LEASE_HELD, after.stderr


def test_a_cli_batch_exports_its_metrics_to_the_otlp_collector_its_environment_names(
    job, tmp_path: Path
) -> None:
    """``OTEL_EXPORTER_OTLP_ENDPOINT`` is all a job needs: the batch's metrics reach the
    collector (here a bare HTTP server taking OTLP/HTTP posts) when the process exits."""
    import http.server
    import threading

    received: list[tuple[str, bytes]] = []

    class Collector(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["Content-Length"]))
            received.append((self.path, body))
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Collector)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    path, _topic = job
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{server.server_port}",
        "OTEL_SERVICE_NAME": "clicks-job",
    }
    try:
        done = subprocess.run(
            [str(Path(sys.executable).with_name("microbatch")), "run", str(path), "--dry-run"],
            env=env, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
    finally:
        server.shutdown()
        server.server_close()

    assert done.returncode == 0, done.stderr
    assert [p for p, _ in received] == ["/v1/metrics"]
    body = received[0][1]
    assert b"microbatch.batch.count" in body and b"microbatch.batch.phase.duration" in body
    assert b"clicks-job" in body and b"dry_run" in body


def test_records_retention_deleted_before_the_next_batch_read_them_exit_5(
    spark, job, kafka_settings, capsys
) -> None:
    from kafka import KafkaAdminClient
    from kafka import TopicPartition as KTP

    path, topic = job
    assert main(["run", str(path), "--json"]) == 0  # 20 of the 30 records
    capsys.readouterr()
    assert main(["status", str(path), "--json"]) == 0
    partitions = json.loads(capsys.readouterr().out)["partitions"]
    unread = {KTP(topic, int(p["partition"].rsplit("[", 1)[1].rstrip("]"))): p["end"]
              for p in partitions if p["lag"] > 0}  # fmt: skip
    assert unread, partitions
    admin = KafkaAdminClient(bootstrap_servers=kafka_settings.kafka_bootstrap_servers)
    try:
        admin.delete_records(unread)  # retention, before the next batch got to them
    finally:
        admin.close()

    assert main(["run", str(path), "--json"]) == ExitCode.DATA_LOSS == 5

    error = json.loads(capsys.readouterr().out)["error"]
    assert error["reason"] == "data_loss" and error["exit_code"] == 5
    assert "is no longer available" in error["message"]
    assert 'on_out_of_range="earliest"' in error["message"]  # what to do
