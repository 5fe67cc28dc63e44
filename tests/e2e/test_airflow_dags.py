"""Airflow 3 loads every DAG in dags/ and runs the smoke DAG for real."""

from __future__ import annotations

import json

import pytest

from tests.e2e.conftest import REPO, run_airflow_script

pytestmark = pytest.mark.e2e

DAGBAG = f"""
import json
from airflow.dag_processing.dagbag import DagBag
bag = DagBag(dag_folder={str(REPO / "dags")!r})
print("RESULT " + json.dumps({{"errors": bag.import_errors, "dags": sorted(bag.dag_ids)}}))
"""

DAG_TEST = f"""
import json
from airflow.dag_processing.dagbag import DagBag
bag = DagBag(dag_folder={str(REPO / "dags")!r})
run = bag.get_dag("microbatch_smoke").test()
tasks = {{ti.task_id: str(ti.state) for ti in run.get_task_instances()}}
print("RESULT " + json.dumps({{"state": str(run.state), "tasks": tasks}}))
"""


def _result(proc) -> dict:
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert lines, f"script printed no result (exit {proc.returncode}):\n{proc.stderr[-4000:]}"
    return json.loads(lines[-1][len("RESULT ") :])


def test_every_dag_file_imports_without_errors(airflow_home):
    result = _result(run_airflow_script(airflow_home, DAGBAG))

    assert result["errors"] == {}
    assert "microbatch_smoke" in result["dags"]


def test_smoke_dag_run_succeeds_against_the_real_stack(airflow_home, stack_settings):
    proc = run_airflow_script(airflow_home, DAG_TEST, stack_settings.to_env())

    result = _result(proc)
    assert result == {"state": "success", "tasks": {"smoke": "success"}}, proc.stderr[-4000:]
