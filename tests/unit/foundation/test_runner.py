"""A batch job's log streams out, its result line comes back, its own error fails it.

With a Spark Connect master the job runs as plain Python, so a tiny script stands in for
a job here: this exercises the real subprocess handling without Spark.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from microbatch import Settings
from microbatch.runner import JobFailedError, run_job

SETTINGS = Settings.from_env(env={}, spark_master="sc://127.0.0.1:1")


def job(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "job.py"
    path.write_text("import json, os, sys\n" + textwrap.dedent(body))
    return path


def test_result_line_is_parsed_and_other_lines_are_echoed(tmp_path):
    script = job(
        tmp_path,
        """
        print("planning", flush=True)
        print("MICROBATCH_RESULT " + json.dumps({"batch_id": 3, "args": sys.argv[1:],
              "who": os.environ["MICROBATCH_CLICKSTREAM_TOPIC"]}))
        """,
    )
    lines: list[str] = []

    env = {"MICROBATCH_CLICKSTREAM_TOPIC": "clicks-x"}

    result = run_job(script, ["--dry-run"], SETTINGS, lines.append, env=env)

    assert result == {"batch_id": 3, "args": ["--dry-run"], "who": "clicks-x"}
    assert "planning" in lines
    assert not any("MICROBATCH_RESULT" in line for line in lines)


def test_failure_carries_the_batch_message_not_the_log_noise(tmp_path):
    script = job(
        tmp_path,
        """
        print("WARN some noisy error-looking line", flush=True)
        print("microbatch run: pipeline 'clicks' batch 4: 9 of 10 records went to the dead",
              file=sys.stderr)
        print("letters, above max_ratio 20.0%", file=sys.stderr)
        sys.exit(1)
        """,
    )

    with pytest.raises(JobFailedError) as info:
        run_job(script, [], SETTINGS, lambda _: None)

    assert str(info.value) == (
        "job.py exited 1: pipeline 'clicks' batch 4: 9 of 10 records went to the dead\n"
        "letters, above max_ratio 20.0%"
    )


def test_a_job_without_a_result_line_fails(tmp_path):
    with pytest.raises(JobFailedError, match="without a MICROBATCH_RESULT"):
        run_job(job(tmp_path, "print('hi')\n"), [], SETTINGS, lambda _: None)
