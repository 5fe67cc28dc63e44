"""Finding the command-line tools the venv ships (``weed``, ``spark-submit``, ``airflow``)."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path


def find_executable(name: str) -> str | None:
    """``name`` next to this interpreter (the venv's ``bin``) first, then on ``PATH``."""
    beside = Path(sys.executable).parent / name
    return str(beside) if beside.exists() else shutil.which(name)
