"""The operator that runs one microbatch Spark job per task."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from airflow.sdk import BaseOperator
from airflow.sdk.exceptions import AirflowException

from microbatch_airflow.connections import (
    KAFKA_CONN_ID,
    S3_CONN_ID,
    SPARK_CONN_ID,
    settings_from_airflow,
)


class MicrobatchJobOperator(BaseOperator):
    """Submit ``job`` (a ``jobs/*.py`` entrypoint) to Spark and return its result.

    The job's log streams into the task log; its ``MICROBATCH_RESULT`` line becomes the
    task's XCom return value; a failed job fails the task with the job's own error lines.
    Services come from the Airflow connections named here when they exist, else from the
    ``MICROBATCH_*`` environment. Secrets travel to the job in its environment only.
    """

    template_fields: Sequence[str] = ("job_args",)
    ui_color = "#e8f1fb"

    def __init__(
        self,
        *,
        job: str,
        job_args: Sequence[str] = (),
        kafka_conn_id: str | None = KAFKA_CONN_ID,
        s3_conn_id: str | None = S3_CONN_ID,
        spark_conn_id: str | None = SPARK_CONN_ID,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.job = job
        self.job_args = list(job_args)
        self.kafka_conn_id = kafka_conn_id
        self.s3_conn_id = s3_conn_id
        self.spark_conn_id = spark_conn_id

    def execute(self, context: Any) -> dict[str, Any]:
        from microbatch.errors import MicrobatchError
        from microbatch.runner import run_job

        settings = settings_from_airflow(self.kafka_conn_id, self.s3_conn_id, self.spark_conn_id)
        self.log.info("microbatch settings: %s", settings.redacted())
        try:
            return run_job(self.job, self.job_args, settings, echo=self.log.info)
        except MicrobatchError as exc:
            raise AirflowException(str(exc)) from None
