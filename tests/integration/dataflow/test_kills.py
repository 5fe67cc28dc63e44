"""The payments dataflow in a real ``microbatch`` process: SIGKILLed before its commit,
or stalled after planning while another run goes ahead (a zombie). Either way the output
and every step's state equal the clean run's."""

from __future__ import annotations

import dataclasses
import signal
from pathlib import Path

import pytest

from microbatch.runtime import BatchOptions, BatchRunner
from tests.integration.dataflow.payments import payments_dataflow
from tests.integration.dataflow.test_payments import VALUES, outcome, rows
from tests.integration.runtime.test_kills import kill, start_cli
from tests.integration.runtime.test_zombies import LEASE_S, wait_stopped

pytestmark = pytest.mark.integration

JOB = """
import dataclasses
from tests.integration.dataflow.payments import payments_dataflow

pipeline = dataclasses.replace(payments_dataflow({topic!r}, {root!r}), lease_timeout_s={lease})
"""


def job_file(topic: str, root: Path) -> Path:
    job = root / "job.py"
    job.write_text(JOB.format(topic=topic, root=str(root), lease=LEASE_S))
    return job


def pipeline(topic: str, root: Path):
    return dataclasses.replace(payments_dataflow(topic, str(root)), lease_timeout_s=LEASE_S)


@pytest.fixture(scope="module")
def whole(spark, kafka_settings, topic, tmp_path_factory):
    """The whole topic in one batch, undisturbed."""
    root = tmp_path_factory.mktemp("whole")
    BatchRunner(spark, pipeline(topic, root), kafka_settings).run(BatchOptions(run_id="w"))
    return {"outcome": outcome(root), "idle": rows(root, "idle")}


@pytest.fixture(scope="module")
def topic(bootstrap, admin) -> str:
    from tests.integration.runtime.test_batches import new_topic, produce

    name = new_topic(admin, 3)
    produce(bootstrap, name, VALUES)
    return name


def test_a_dataflow_killed_before_its_commit_gives_the_clean_output_when_rerun(
    whole, spark, kafka_settings, topic, tmp_path: Path
) -> None:
    crashed = start_cli(kafka_settings, ["run", str(job_file(topic, tmp_path)), "--run-id", "k"],
                        "before_commit")  # fmt: skip
    wait_stopped(crashed)  # every step's state and output staged, nothing committed
    kill(crashed)
    BatchRunner(spark, pipeline(topic, tmp_path), kafka_settings).run(BatchOptions(run_id="r"))
    assert outcome(tmp_path) == whole["outcome"]
    assert rows(tmp_path, "idle") == whole["idle"]


def test_a_dataflow_zombie_overwrites_nothing_the_next_run_committed(
    whole, spark, kafka_settings, topic, tmp_path: Path
) -> None:
    job = job_file(topic, tmp_path)
    zombie = start_cli(kafka_settings, ["run", str(job), "--run-id", "z"], "after_plan")
    wait_stopped(zombie)
    import time

    time.sleep(LEASE_S + 0.5)  # its lease expires while it sleeps
    BatchRunner(spark, pipeline(topic, tmp_path), kafka_settings).run(BatchOptions(run_id="n"))
    committed = outcome(tmp_path)
    zombie.send_signal(signal.SIGCONT)
    out, _ = zombie.communicate(timeout=300)
    assert zombie.returncode != 0, out
    assert "fenced" in out or "stale" in out or "another run" in out, out
    assert outcome(tmp_path) == committed == whole["outcome"]
