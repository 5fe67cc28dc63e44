"""Run a Spark job with spark-submit, stream its log, and return its result line.

Jobs print ``MICROBATCH_RESULT {json}`` as their last line; this runner forwards every
other line to the caller's logger (the Airflow task log, the demo's terminal) and fails
with the job's own error message when it exits non-zero.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from microbatch.errors import MicrobatchError
from microbatch.settings import Settings
from microbatch.submit import reachable_engine, spark_submit_command

RESULT_PREFIX = "MICROBATCH_RESULT "
ERROR_PREFIX = "microbatch run: "  # the line the CLI prints when a batch fails
MAX_ERROR_CHARS = 2000
log = logging.getLogger(__name__)


class JobFailedError(MicrobatchError):
    """The job exited non-zero; the message is the batch's own error text when it printed
    one (``microbatch run: ...``), else the job's last error lines."""


def run_job(
    job: str | Path,
    job_args: Sequence[str] = (),
    settings: Settings | None = None,
    echo: Callable[[str], None] | None = None,
    *,
    env: Mapping[str, str] | None = None,
    started: Callable[[subprocess.Popen[str]], None] | None = None,
) -> dict[str, Any]:
    """Run ``job`` and return its (last) ``MICROBATCH_RESULT``; every other line goes to
    ``echo``. ``env`` is extra environment for the job (``MICROBATCH_<PIPELINE>_*``).

    The job runs in its own process group, which is stopped whole (spark-submit, the JVM,
    the Python driver) when this call ends by an exception — a timeout, a kill of the
    caller's task — so no batch keeps running behind its caller's back. ``started`` gets
    the process, for a caller that must stop it from elsewhere (:func:`stop_job`). A
    Spark Connect master that does not answer falls back to a cold ``spark-submit``
    (:func:`microbatch.submit.reachable_engine`)."""
    settings = settings or Settings.from_env()
    echo = echo or log.info
    if "--dry-run" not in job_args:  # a dry run plans only: it never starts Spark
        settings = reachable_engine(settings, echo)
    argv, job_env = spark_submit_command(settings, job, job_args)
    job_env.update(env or {})
    echo("running: " + " ".join(argv))  # argv never holds secrets: they travel in job_env
    result: dict[str, Any] | None = None
    error: list[str] = []
    recent: deque[str] = deque(maxlen=20)
    with subprocess.Popen(
        argv,
        env=job_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        bufsize=1,
        start_new_session=True,
    ) as proc:
        if started is not None:
            started(proc)
        assert proc.stdout is not None
        try:
            for raw in proc.stdout:
                line = raw.rstrip("\n")
                if line.startswith(RESULT_PREFIX):
                    result = json.loads(line[len(RESULT_PREFIX) :])
                    continue
                if line.startswith(ERROR_PREFIX):
                    error = [line[len(ERROR_PREFIX) :]]
                elif error:
                    error.append(line)  # a multi-line message (a Spark task error)
                recent.append(line)
                echo(line)
        except BaseException:
            stop_job(proc)
            raise
    name = Path(job).name
    if proc.returncode != 0:
        if error:
            detail = "\n".join(error).strip()
            raise JobFailedError(f"{name} exited {proc.returncode}: {detail[:MAX_ERROR_CHARS]}")
        errors = [ln for ln in recent if "error" in ln.lower() or "failed" in ln.lower()]
        detail = "\n".join(errors[-5:] or list(recent)[-5:])
        raise JobFailedError(f"Spark job {name} exited {proc.returncode}:\n{detail}")
    if result is None:
        raise JobFailedError(f"Spark job {name} finished without a MICROBATCH_RESULT line")
    return result


def stop_job(proc: subprocess.Popen[Any], grace_s: float = 10.0) -> None:
    """Stop a job started by :func:`run_job` and everything it started: SIGTERM to its
    process group, then SIGKILL to whatever of the group is left after ``grace_s``."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:  # the group is gone already
        return
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=grace_s)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
