"""A dry run plans without Spark: no JVM, no session, even when Spark cannot start at all.

Each run is a fresh process whose ``SPARK_HOME`` holds a trap: a ``bin/spark-submit`` that
records that it was called and fails. pyspark starts its JVM through that script, so a
process that tried to start Spark leaves the mark and fails.
"""

from __future__ import annotations

import dataclasses
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from microbatch.runner import run_job
from tests.integration.runtime.test_batches import clicks, new_topic, produce

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[3]

JOB = """
import sys
from microbatch.runtime import KafkaSource, KeyedProcessFunction, ParquetSink, Pipeline

class Count(KeyedProcessFunction):
    def process(self, key, records, ctx):
        ctx.emit({{"user": key, "clicks": len(records)}})

pipeline = Pipeline(
    name="dry",
    source=KafkaSource(topics=({topic!r},)),
    key_by="user",
    process=Count(),
    sinks=[ParquetSink("counts", {root!r} + "/counts")],
    checkpoints={root!r} + "/checkpoints",
    max_parallelism=8,
    parallelism=2,
)

if __name__ == "__main__":
    from microbatch.cli import main
    sys.exit(main(["run", f"{{__file__}}:pipeline", *sys.argv[1:]]))
"""


@pytest.fixture
def trapped(admin, bootstrap, kafka_settings, tmp_path: Path, monkeypatch):
    """(job file, settings for local Spark, the trap's mark) with the trap in SPARK_HOME."""
    topic = new_topic(admin, 2)
    produce(bootstrap, topic, clicks(12))
    job = tmp_path / "dry_job.py"
    job.write_text(JOB.format(topic=topic, root=str(tmp_path / "out")))
    mark = tmp_path / "spark-was-started"
    script = tmp_path / "spark-home" / "bin" / "spark-submit"
    script.parent.mkdir(parents=True)
    script.write_text(f"#!/bin/sh\ntouch {mark}\nexit 1\n")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("SPARK_HOME", str(tmp_path / "spark-home"))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    return job, dataclasses.replace(kafka_settings, spark_master="local[2]"), mark


def test_dry_run_job_plans_without_starting_spark(trapped) -> None:
    job, settings, mark = trapped
    lines: list[str] = []

    plan = run_job(job, ["--dry-run"], settings, lines.append)

    assert "spark-submit" not in lines[0], "a dry run must not go through spark-submit"
    assert not mark.exists(), "a dry run started Spark"
    assert plan["status"] == "dry_run"
    assert sum(r["until"] - r["from"] for r in plan["ranges"]) == 12


def test_dry_run_cli_plans_without_starting_spark_but_a_real_run_needs_it(trapped) -> None:
    job, settings, mark = trapped
    env = {**os.environ, **settings.to_env()}
    cli = [sys.executable, "-m", "microbatch.cli", "run", str(job)]

    dry = subprocess.run([*cli, "--dry-run", "--json"], env=env, capture_output=True, text=True)

    assert dry.returncode == 0, dry.stderr
    assert '"status": "dry_run"' in dry.stdout
    assert not mark.exists(), "a dry run started Spark"
    # The trap works: a real batch has to start Spark, and it cannot here.
    real = subprocess.run(cli, env=env, capture_output=True, text=True)
    assert real.returncode == 1
    assert mark.exists()
