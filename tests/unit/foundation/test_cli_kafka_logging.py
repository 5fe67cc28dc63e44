"""kafka-python's "It is blocking the event loop" warnings stay out of the CLI's output.

kafka-python 3 warns when a step of its clients' IO loop overruns 0.1 s
(``kafka/net/selector.py``); in a batch that is other work holding the GIL, nothing a
user can act on. Here the step overruns on purpose: the selector's threshold is lowered
to ~0 (its own setting), so any step trips it without holding the GIL for real."""

from __future__ import annotations

import logging
import runpy
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from microbatch.cli import main

NOISE = "blocking the event loop"

JOB = """
from kafka.net.selector import NetworkSelector

from microbatch.runtime import KafkaSource, KeyedProcessFunction, ParquetSink, Pipeline


def slow_kafka_step():
    net = NetworkSelector(slow_task_threshold_secs=1e-9)

    async def step():
        return None

    try:
        net.run(step)
    finally:
        net.close()


class Nothing(KeyedProcessFunction):
    def process(self, key, records, ctx):
        pass


def pipeline(settings, env):
    slow_kafka_step()  # while the command runs, as a batch's Kafka clients would
    return Pipeline(
        name="quiet",
        source=KafkaSource(topics=("clicks",)),
        key_by="user",
        process=Nothing(),
        sinks=[ParquetSink("out", {out!r})],
        checkpoints={checkpoints!r},
    )


if __name__ == "__main__":  # the same step outside the CLI, with the CLI's log format
    import logging

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    slow_kafka_step()
"""


@pytest.fixture
def job(tmp_path: Path) -> Path:
    path = tmp_path / "job.py"
    path.write_text(JOB.format(out=str(tmp_path / "out"), checkpoints=str(tmp_path / "cp")))
    return path


@pytest.fixture
def selector_logger() -> Iterator[logging.Logger]:
    """kafka-python's selector logger as a fresh process has it (other tests ran main())."""
    logger = logging.getLogger("kafka.net.selector")
    level = logger.level
    logger.setLevel(logging.NOTSET)
    yield logger
    logger.setLevel(level)


def test_the_slow_step_warns_without_the_cli(job, selector_logger, caplog):
    slow_kafka_step = runpy.run_path(str(job))["slow_kafka_step"]  # not as __main__

    slow_kafka_step()

    assert NOISE in caplog.text


def test_the_slow_step_during_a_command_does_not_reach_its_output(
    job, selector_logger, caplog, capsys
):
    assert main(["status", str(job)]) == 0

    out, err = capsys.readouterr()
    assert "pipeline quiet: no checkpoint yet" in out
    assert NOISE not in out + err + caplog.text
    assert selector_logger.level == logging.ERROR  # its errors still show


def test_a_level_the_user_chose_for_that_logger_is_kept(job, selector_logger):
    selector_logger.setLevel(logging.DEBUG)

    assert main(["status", str(job)]) == 0

    assert selector_logger.level == logging.DEBUG


def test_the_microbatch_command_prints_no_slow_task_warning(job):
    """Across the real process boundary: the console command and its log format."""
    python = sys.executable
    command = subprocess.run(
        [python, "-m", "microbatch.cli", "status", str(job)], capture_output=True, text=True
    )
    plain = subprocess.run([python, str(job)], capture_output=True, text=True)

    assert command.returncode == 0, command.stderr
    assert NOISE not in command.stdout + command.stderr
    assert "WARNING kafka.net.selector: Task" in plain.stderr and NOISE in plain.stderr
