"""Foundation smoke DAG: one spark-submit of jobs/smoke.py against the configured stack.

Proves Airflow → spark-submit → Kafka → Spark → S3 works end to end; the pipeline DAGs
of later issues follow the same shape.
"""

from __future__ import annotations

from datetime import datetime

from airflow.sdk import dag, task

JOB = __file__.rsplit("/dags/", 1)[0] + "/jobs/smoke.py"


@dag(
    dag_id="microbatch_smoke",
    schedule=None,
    start_date=datetime(2026, 1, 1),
    catchup=False,
    max_active_runs=1,
    tags=["microbatch", "smoke"],
)
def microbatch_smoke():
    @task
    def smoke(run_id: str | None = None) -> dict:
        from microbatch.runner import run_job

        safe_id = "".join(c if c.isalnum() else "-" for c in (run_id or "manual"))[-40:]
        return run_job(JOB, ["--events", "1000", "--run-id", safe_id])

    smoke()


microbatch_smoke()
