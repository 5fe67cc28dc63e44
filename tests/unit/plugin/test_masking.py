"""Secrets of the task's settings are masked in task logs and rendered template fields."""

from __future__ import annotations

import json
from types import SimpleNamespace

from airflow.sdk.log import redact

from microbatch_airflow.operators import MicrobatchBatchOperator, MicrobatchNewDataOperator

SASL_PASSWORD = "sasl-pw-only-in-the-environment-7431"
S3_SECRET = "s3-secret-only-in-the-environment-7431"


def secured_env(monkeypatch) -> None:
    monkeypatch.setenv("MICROBATCH_KAFKA_BOOTSTRAP_SERVERS", "broker.internal:9096")
    monkeypatch.setenv("MICROBATCH_KAFKA_SECURITY_PROTOCOL", "SASL_SSL")
    monkeypatch.setenv("MICROBATCH_KAFKA_SASL_MECHANISM", "SCRAM-SHA-512")
    monkeypatch.setenv("MICROBATCH_KAFKA_SASL_USERNAME", "etl")
    monkeypatch.setenv("MICROBATCH_KAFKA_SASL_PASSWORD", SASL_PASSWORD)
    monkeypatch.setenv("MICROBATCH_S3_ENDPOINT_URL", "https://minio.internal")
    monkeypatch.setenv("MICROBATCH_S3_ACCESS_KEY_ID", "etl-key")
    monkeypatch.setenv("MICROBATCH_S3_SECRET_ACCESS_KEY", S3_SECRET)


def test_secrets_from_the_environment_are_redacted_in_rendered_fields_and_log_lines(
    monkeypatch,
):
    from airflow.sdk.execution_time.task_runner import _serialize_rendered_fields

    secured_env(monkeypatch)
    line = f"connecting to broker.internal:9096 as etl/{SASL_PASSWORD} and S3 with {S3_SECRET}"
    assert redact(line) == line  # nobody told the masker yet
    op = MicrobatchBatchOperator(
        task_id="batch",
        job="jobs/clickstream.py",
        job_args=["--note", "{{ params.note }}"],
        kafka_conn_id=None,  # no Airflow connection: the secrets come from MICROBATCH_*
        s3_conn_id=None,
        spark_conn_id=None,
        postgres_conn_id=None,
    )
    context = {
        "params": {"note": f"password was {SASL_PASSWORD}"},
        "dag": SimpleNamespace(dag_id="clickstream"),
        "run_id": "manual__1",
    }

    op.render_template_fields(context)

    assert op.job_args == ["--note", f"password was {SASL_PASSWORD}"]  # the job gets it
    stored = json.dumps(_serialize_rendered_fields(op))  # what the UI's Rendered tab shows
    assert SASL_PASSWORD not in stored and "password was ***" in stored
    masked = redact(line)
    assert SASL_PASSWORD not in masked and S3_SECRET not in masked
    assert masked == "connecting to broker.internal:9096 as etl/*** and S3 with ***"


def test_the_new_data_check_masks_the_same_secrets_before_rendering(monkeypatch):
    secured_env(monkeypatch)
    monkeypatch.setenv("MICROBATCH_KAFKA_SASL_PASSWORD", "another-sasl-pw-9902")
    op = MicrobatchNewDataOperator(
        task_id="new_data", job="jobs/clickstream.py", env={"NOTE": "{{ params.note }}"},
        kafka_conn_id=None, s3_conn_id=None,
    )  # fmt: skip

    op.render_template_fields({"params": {"note": "n"}})

    assert redact("pw another-sasl-pw-9902") == "pw ***"


def test_the_triggerer_masks_the_secrets_of_the_settings_it_resolves(monkeypatch):
    import asyncio

    from microbatch_airflow.connections import asettings_from_airflow

    secured_env(monkeypatch)
    monkeypatch.setenv("MICROBATCH_KAFKA_SASL_PASSWORD", "triggerer-sasl-pw-5531")

    settings = asyncio.run(asettings_from_airflow(None, None, None))

    assert settings.kafka_sasl_password == "triggerer-sasl-pw-5531"
    assert redact("polling with triggerer-sasl-pw-5531") == "polling with ***"
