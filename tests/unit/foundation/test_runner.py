"""A batch job's log streams out, its result line comes back, its own error fails it.

With a Spark Connect master the job runs as plain Python, so a tiny script stands in for
a job here: this exercises the real subprocess handling without Spark.
"""

from __future__ import annotations

import textwrap
import time
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


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def _gone_soon(pid: int, within_s: float = 5.0) -> bool:
    """Signals are asynchronous: a killed process may linger a moment before it is gone."""
    deadline = time.monotonic() + within_s
    while _alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_an_interrupted_caller_stops_the_job_and_everything_it_started(tmp_path):
    """A task timeout or kill interrupts run_job: the job's whole process tree goes with
    it (spark-submit's JVM and driver would otherwise keep running the batch)."""
    script = job(
        tmp_path,
        """
        import subprocess, time
        child = subprocess.Popen(["sleep", "300"])
        print("child", child.pid, flush=True)
        time.sleep(300)
        """,
    )
    pids: list[int] = []

    def echo(line: str) -> None:
        if line.startswith("child "):
            pids.append(int(line.split()[1]))
            raise TimeoutError("the task's execution_timeout")

    with pytest.raises(TimeoutError):
        run_job(script, ["--dry-run"], SETTINGS, echo)

    assert pids and _gone_soon(pids[0])


def test_stop_job_ends_a_running_job_from_elsewhere(tmp_path):
    """What the operators' on_kill does with the process run_job handed them."""
    import threading

    from microbatch.runner import stop_job

    script = job(tmp_path, "import time\nprint('started', flush=True)\ntime.sleep(300)\n")
    started: list = []
    failed: list[BaseException] = []

    def run() -> None:
        try:
            run_job(script, ["--dry-run"], SETTINGS, lambda _: None, started=started.append)
        except JobFailedError as e:
            failed.append(e)

    thread = threading.Thread(target=run)
    thread.start()
    while not started:
        threading.Event().wait(0.05)
    stop_job(started[0], grace_s=5)
    thread.join(timeout=30)

    assert not thread.is_alive() and failed  # the killed job fails its caller
