"""Run a Spark job with spark-submit, stream its log, and return its result line.

Jobs print ``MICROBATCH_RESULT {json}`` as their last line; this runner forwards every
other line to the caller's logger (the Airflow task log, the demo's terminal) and fails
with the job's own error message when it exits non-zero.
"""

from __future__ import annotations

import json
import logging
import subprocess
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from microbatch.errors import MicrobatchError
from microbatch.settings import Settings
from microbatch.submit import spark_submit_command

RESULT_PREFIX = "MICROBATCH_RESULT "
log = logging.getLogger(__name__)


class JobFailedError(MicrobatchError):
    """spark-submit exited non-zero; the message carries the job's last error lines."""


def run_job(
    job: str | Path,
    job_args: Sequence[str] = (),
    settings: Settings | None = None,
    echo: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    settings = settings or Settings.from_env()
    echo = echo or log.info
    argv, env = spark_submit_command(settings, job, job_args)
    echo("running: " + " ".join(argv))
    result: dict[str, Any] | None = None
    recent: deque[str] = deque(maxlen=20)
    with subprocess.Popen(
        argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1
    ) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            line = line.rstrip("\n")
            if line.startswith(RESULT_PREFIX):
                result = json.loads(line[len(RESULT_PREFIX) :])
                continue
            recent.append(line)
            echo(line)
    if proc.returncode != 0:
        errors = [ln for ln in recent if "error" in ln.lower() or "failed" in ln.lower()]
        detail = "\n".join(errors[-5:] or list(recent)[-5:])
        raise JobFailedError(f"Spark job {Path(job).name} exited {proc.returncode}:\n{detail}")
    if result is None:
        raise JobFailedError(f"Spark job {Path(job).name} finished without a result line")
    return result
