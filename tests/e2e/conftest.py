"""Airflow runs in subprocesses with its own AIRFLOW_HOME, so its config never leaks
into the pytest process. The metadata DB is migrated once per test run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent


def airflow_env(home: Path, extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        {
            "AIRFLOW_HOME": str(home),
            "AIRFLOW__CORE__DAGS_FOLDER": str(REPO / "dags"),
            "AIRFLOW__CORE__PLUGINS_FOLDER": str(REPO / "plugins"),
            "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
            "AIRFLOW__CORE__UNIT_TEST_MODE": "False",
            "PATH": f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}",
            "PYSPARK_PYTHON": sys.executable,
        }
    )
    env.update(extra or {})
    return env


@pytest.fixture(scope="session")
def airflow_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    home = tmp_path_factory.mktemp("airflow")
    result = subprocess.run(
        [str(VENV_BIN / "airflow"), "db", "migrate"],
        env=airflow_env(home),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, f"airflow db migrate failed:\n{result.stderr[-3000:]}"
    return home


def run_airflow_script(home: Path, code: str, extra_env: dict[str, str] | None = None):
    """Run Python ``code`` in a fresh interpreter configured for ``home``."""
    return subprocess.run(
        [sys.executable, "-c", code],
        env=airflow_env(home, extra_env),
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
        cwd=REPO,
    )
