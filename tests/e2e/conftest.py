"""Fixtures of the e2e tests. Airflow's metadata DB is on the run's PostgreSQL (as in
production: on SQLite the scheduler dies under overlapping writers), one database per
Airflow home, migrated once per test run. The one ``airflow standalone`` of the run and
its companions come from :mod:`tests.e2e.standalone`."""

from __future__ import annotations

import itertools
import subprocess
from collections.abc import Callable

import pytest

from tests.e2e.harness import VENV_BIN, AirflowHome, airflow_env
from tests.e2e.standalone import chrome, smoke_run, standalone

__all__ = ["airflow_home", "chrome", "new_airflow_home", "smoke_run", "standalone"]


@pytest.fixture(scope="session")
def new_airflow_home(postgres, tmp_path_factory) -> Callable[[str], AirflowHome]:
    """A factory of fresh Airflow homes, each with a database of its own, copied from one
    migrated once per run (``CREATE DATABASE ... TEMPLATE``: ~50 ms instead of a migration).
    """
    template = "airflow_template"
    postgres.create_database(template)
    scratch = AirflowHome(
        tmp_path_factory.mktemp("airflow-template"), postgres.airflow_env(template)
    )
    result = subprocess.run(
        [str(VENV_BIN / "airflow"), "db", "migrate"],
        env=airflow_env(scratch),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, f"airflow db migrate failed:\n{result.stderr[-3000:]}"
    made = itertools.count(1)

    def make(name: str) -> AirflowHome:
        database = f"airflow_{name}_{next(made)}"
        postgres.create_database(database, template=template)
        return AirflowHome(tmp_path_factory.mktemp(name), postgres.airflow_env(database))

    return make


@pytest.fixture(scope="session")
def airflow_home(new_airflow_home) -> AirflowHome:
    """The home the ``dag.test()`` scripts share."""
    return new_airflow_home("airflow")
