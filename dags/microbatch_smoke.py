"""Foundation smoke DAG: one spark-submit of jobs/smoke.py against the configured stack.

Proves Airflow → spark-submit → Kafka → Spark → S3 works end to end; the pipeline DAGs
of later issues follow the same shape.
"""

from __future__ import annotations

from datetime import datetime
from pathlib import Path

from airflow.sdk import dag

from microbatch_airflow.operators import MicrobatchJobOperator

JOB = str(Path(__file__).resolve().parents[1] / "jobs" / "smoke.py")


@dag(
    dag_id="microbatch_smoke",
    schedule=None,
    start_date=datetime(2026, 1, 1),
    catchup=False,
    max_active_runs=1,
    tags=["microbatch", "smoke"],
)
def microbatch_smoke():
    MicrobatchJobOperator(
        task_id="smoke",
        job=JOB,
        job_args=[
            "--events",
            "1000",
            "--run-id",
            "{{ run_id | replace(':', '-') | replace('+', '-') }}",
        ],
    )


microbatch_smoke()
