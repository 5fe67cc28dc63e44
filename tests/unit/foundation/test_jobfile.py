"""Loading a job file's pipeline: an object, or a function of the caller's settings and
environment, called when loaded and never reading the process environment itself."""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

import pytest

from microbatch.errors import ConfigError
from microbatch.jobfile import load_pipeline
from microbatch.settings import Settings

REPO = Path(__file__).resolve().parents[3]
CLICKSTREAM_JOB = REPO / "jobs" / "clickstream.py"


def write_job(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "job.py"
    path.write_text(
        "from microbatch.examples.clickstream import ClickstreamConfig, clickstream_pipeline\n"
        + textwrap.dedent(body)
    )
    return path


def test_load_clickstream_job_with_settings_and_env_builds_their_pipeline() -> None:
    settings = Settings.from_env(env={}, s3_bucket="bucket-a")
    env = {"MICROBATCH_CLICKSTREAM_TOPIC": "clicks-a", "MICROBATCH_CLICKSTREAM_PARALLELISM": "3"}

    pipeline = load_pipeline(str(CLICKSTREAM_JOB), settings, env)

    assert pipeline.source.topics == ("clicks-a",)
    assert pipeline.parallelism == 3
    assert pipeline.checkpoints == "s3://bucket-a/clickstream/checkpoints"


def test_load_clickstream_job_without_arguments_reads_the_process_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("MICROBATCH_S3_BUCKET", "bucket-b")
    monkeypatch.setenv("MICROBATCH_CLICKSTREAM_TOPIC", "clicks-b")

    pipeline = load_pipeline(f"{CLICKSTREAM_JOB}:pipeline")

    assert pipeline.source.topics == ("clicks-b",)
    assert pipeline.checkpoints == "s3://bucket-b/clickstream/checkpoints"


def test_load_job_with_env_leaves_the_process_environment_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("MICROBATCH_CLICKSTREAM_TOPIC", raising=False)
    before = dict(os.environ)

    load_pipeline(str(CLICKSTREAM_JOB), Settings(), {"MICROBATCH_CLICKSTREAM_TOPIC": "t"})

    assert dict(os.environ) == before


def test_load_job_with_pipeline_object_returns_it(tmp_path: Path) -> None:
    job = write_job(tmp_path, "pipeline = clickstream_pipeline(ClickstreamConfig(topic='obj'))")

    assert load_pipeline(str(job), Settings(), {}).source.topics == ("obj",)


def test_load_job_with_function_of_no_arguments_calls_it(tmp_path: Path) -> None:
    job = write_job(
        tmp_path,
        """
        def build():
            return clickstream_pipeline(ClickstreamConfig(topic="built"))
        """,
    )

    assert load_pipeline(f"{job}:build", Settings(), {}).source.topics == ("built",)


def test_load_job_whose_attribute_is_no_pipeline_names_it(tmp_path: Path) -> None:
    job = write_job(tmp_path, "pipeline = 42")

    with pytest.raises(ConfigError, match="'pipeline' is not a microbatch Pipeline"):
        load_pipeline(str(job))


def test_load_missing_job_file_says_so(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_pipeline(str(tmp_path / "absent.py"))


def test_load_job_naming_a_dataflow_builds_its_pipeline(tmp_path: Path) -> None:
    job = tmp_path / "flow_job.py"
    job.write_text(
        textwrap.dedent(
            """
            from microbatch.dataflow import Dataflow
            from microbatch.runtime import KafkaSource, KeyedProcessFunction, ParquetSink

            class Echo(KeyedProcessFunction):
                def process(self, key, records, ctx):
                    for r in records:
                        ctx.emit(r)

            pipeline = Dataflow("flow", checkpoints="/tmp/flow")
            first = pipeline.source(KafkaSource(topics=("t",))).key_by("k")
            first.process(Echo(), uid="echo").key_by("j").process(Echo(), uid="again").to(
                ParquetSink("out", "/tmp/flow-out")
            )
            """
        )
    )
    loaded = load_pipeline(str(job))
    assert loaded.name == "flow" and loaded.keyed_uids == ("echo", "again")
