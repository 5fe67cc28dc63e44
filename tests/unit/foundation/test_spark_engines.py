"""How a job reaches its engine: spark-submit, plain Python for Connect and dry runs, and
the shared Connect session id of warm mode."""

from __future__ import annotations

import datetime as dt
import socket
import sys
import uuid
from pathlib import Path

import pytest

from microbatch.settings import Settings
from microbatch.spark import connect_session_id, with_session_id
from microbatch.submit import FALLBACK_MASTER, reachable_engine, spark_submit_command

JOB = Path(__file__).resolve().parents[3] / "jobs" / "clickstream.py"
DAY = dt.date(2026, 1, 2)


def test_spark_submit_command_classic_master_goes_through_spark_submit() -> None:
    argv, env = spark_submit_command(Settings(spark_master="local[2]"), JOB, ["--parallelism", "3"])
    assert Path(argv[0]).name == "spark-submit"
    assert argv[1:3] == ["--master", "local[2]"]
    assert argv[-3:] == [str(JOB), "--parallelism", "3"]
    assert env["MICROBATCH_SPARK_MASTER"] == "local[2]"


@pytest.mark.parametrize(
    ("master", "args"),
    [("sc://127.0.0.1:15002", []), ("local[2]", ["--dry-run"]), ("spark://h:7077", ["--dry-run"])],
)
def test_spark_submit_command_connect_or_dry_run_is_plain_python(master, args) -> None:
    argv, _ = spark_submit_command(Settings(spark_master=master), JOB, args)
    assert argv == [sys.executable, str(JOB), *args]


def test_connect_session_id_is_stable_per_app_and_day_and_changes_otherwise() -> None:
    one = connect_session_id("sc://h:15002", "microbatch-clicks", DAY)
    assert one == connect_session_id("sc://h:15002", "microbatch-clicks", DAY)
    others = {
        connect_session_id("sc://h:15002", "microbatch-other", DAY),
        connect_session_id("sc://h:15002", "microbatch-clicks", DAY + dt.timedelta(days=1)),
        connect_session_id("sc://h:15002", "microbatch-clicks", DAY, attempt=1),
        connect_session_id("sc://other:15002", "microbatch-clicks", DAY),
    }
    assert one not in others and len(others) == 4
    assert uuid.UUID(one).version == 4  # the Connect client accepts only version-4 ids


def test_with_session_id_adds_the_parameter_to_any_connect_url() -> None:
    assert with_session_id("sc://h:15002", "abc") == "sc://h:15002/;session_id=abc"
    assert with_session_id("sc://h:15002/", "abc") == "sc://h:15002/;session_id=abc"
    assert with_session_id("sc://h:1/;token=t", "abc") == "sc://h:1/;token=t;session_id=abc"


def test_a_connect_server_that_does_not_answer_falls_back_to_spark_submit_and_says_so() -> None:
    with socket.socket() as closed:  # bound, never listening: connections are refused
        closed.bind(("127.0.0.1", 0))
        master = f"sc://127.0.0.1:{closed.getsockname()[1]}"
        said: list[str] = []

        settings = reachable_engine(Settings(spark_master=master), said.append)

    assert settings.spark_master == FALLBACK_MASTER
    assert len(said) == 1 and master in said[0] and "spark-submit" in said[0]
    argv, env = spark_submit_command(settings, JOB)
    assert Path(argv[0]).name == "spark-submit" and env["MICROBATCH_SPARK_MASTER"] == "local[*]"


def test_a_connect_server_that_answers_keeps_the_batch_warm() -> None:
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        master = f"sc://127.0.0.1:{server.getsockname()[1]}/;session_id=abc"
        said: list[str] = []

        settings = reachable_engine(Settings(spark_master=master), said.append)

    assert settings.spark_master == master and said == []


def test_classic_masters_are_never_probed() -> None:
    said: list[str] = []
    settings = reachable_engine(Settings(spark_master="spark://nowhere:7077"), said.append)
    assert settings.spark_master == "spark://nowhere:7077" and said == []
