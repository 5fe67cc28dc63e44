"""Airflow 3 loads every DAG in dags/ and runs the smoke DAG for real."""

from __future__ import annotations

import json

import pytest

from tests.e2e.harness import REPO, run_airflow_script

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
    assert {"microbatch_smoke", "clickstream"} <= set(result["dags"])


def test_smoke_dag_run_succeeds_against_the_real_stack(airflow_home, stack_settings):
    proc = run_airflow_script(airflow_home, DAG_TEST, stack_settings.to_env())

    result = _result(proc)
    assert result == {"state": "success", "tasks": {"smoke": "success"}}, proc.stderr[-4000:]


def test_connections_override_the_environment_and_the_secret_is_never_printed(
    airflow_home, stack_settings
):
    kafka_conn = {
        "conn_type": "kafka",
        "extra": {"bootstrap_servers": stack_settings.kafka_bootstrap_servers},
    }
    s3_conn = {
        "conn_type": "aws",
        "login": stack_settings.s3_access_key_id,
        "password": stack_settings.s3_secret_access_key,
        "extra": {"endpoint_url": stack_settings.s3_endpoint_url},
    }
    env = stack_settings.to_env() | {
        # The environment points nowhere useful: only the connections can make this pass.
        "MICROBATCH_KAFKA_BOOTSTRAP_SERVERS": "127.0.0.1:1",
        "MICROBATCH_S3_SECRET_ACCESS_KEY": "wrong-secret",
        "AIRFLOW_CONN_MICROBATCH_KAFKA": json.dumps(kafka_conn),
        "AIRFLOW_CONN_MICROBATCH_S3": json.dumps(s3_conn),
    }

    proc = run_airflow_script(airflow_home, DAG_TEST, env)

    result = _result(proc)
    assert result == {"state": "success", "tasks": {"smoke": "success"}}, proc.stderr[-4000:]
    output = proc.stdout + proc.stderr
    assert "microbatch settings:" in output, "task log not captured; the leak check would be void"
    assert stack_settings.s3_secret_access_key not in output, "S3 secret leaked into the log"
