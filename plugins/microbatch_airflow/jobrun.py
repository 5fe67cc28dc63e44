"""Run one batch of a pipeline job and stream its log (spark-submit, or plain Python for
Spark Connect — :func:`microbatch.submit.spark_submit_command` decides).

Like :func:`microbatch.runner.run_job`, plus what a task needs: extra environment for the
job (``MICROBATCH_<PIPELINE>_*`` configuration) and, when the batch fails, the batch's own
message — the ``microbatch run: <message>`` line the CLI prints — instead of log noise.
"""

from __future__ import annotations

import json
import subprocess
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from microbatch.errors import MicrobatchError
from microbatch.settings import Settings

RESULT_PREFIX = "MICROBATCH_RESULT "
ERROR_PREFIX = "microbatch run: "
MAX_ERROR_CHARS = 2000


class BatchFailedError(MicrobatchError):
    """The batch exited non-zero; the message is the batch's own error text."""


def run_batch_job(
    job: str | Path,
    args: Sequence[str],
    settings: Settings,
    *,
    env: Mapping[str, str] | None = None,
    echo: Callable[[str], None],
) -> dict[str, Any]:
    """The batch's ``MICROBATCH_RESULT`` (the last one); every other line goes to ``echo``."""
    from microbatch.submit import spark_submit_command

    argv, job_env = spark_submit_command(settings, job, args)
    job_env.update(env or {})
    echo("running: " + " ".join(argv))  # argv never holds secrets: they travel in job_env
    result: dict[str, Any] | None = None
    error: list[str] = []
    recent: deque[str] = deque(maxlen=20)
    with subprocess.Popen(
        argv, env=job_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1
    ) as proc:
        assert proc.stdout is not None
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
    name = Path(job).name
    if proc.returncode != 0:
        detail = "\n".join(error).strip() or "\n".join(list(recent)[-5:])
        raise BatchFailedError(f"{name} exited {proc.returncode}: {detail[:MAX_ERROR_CHARS]}")
    if result is None:
        raise BatchFailedError(f"{name} finished without a MICROBATCH_RESULT line")
    return result
