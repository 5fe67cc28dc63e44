"""The batch task acts on its job's exit code: wait for a held lease, fail config errors
and data loss without retries, retry the rest. The job is a real process that exits
with the code the ``microbatch`` CLI would."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import pytest
from airflow.sdk.exceptions import AirflowException, AirflowFailException, TaskDeferred

from microbatch.errors import ExitCode
from microbatch_airflow.operators import MicrobatchBatchOperator

CONTEXT = {"data_interval_end": dt.datetime(2026, 11, 25, 10, 5, tzinfo=dt.UTC), "params": {}}


def batch_task(tmp_path: Path, code: ExitCode, message: str, **kwargs) -> MicrobatchBatchOperator:
    """A batch task whose job prints the CLI's error line and exits with ``code`` (a dry
    run: the job runs as a plain Python process, no spark-submit)."""
    job = tmp_path / "job.py"
    job.write_text(
        f"import sys\nprint('microbatch run: ' + {message!r}, file=sys.stderr)\n"
        f"sys.exit({int(code)})\n"
    )
    return MicrobatchBatchOperator(
        task_id="batch", job=str(job), dry_run=True, run_id="clickstream/manual__1",
        kafka_conn_id=None, s3_conn_id=None, spark_conn_id=None, **kwargs,
    )  # fmt: skip


def test_a_held_lease_defers_to_the_triggerer_and_tries_again(tmp_path):
    op = batch_task(tmp_path, ExitCode.LEASE_HELD, "pipeline 'p' is being run by 'other'",
                    lease_wait_s=45)  # fmt: skip

    before = dt.datetime.now(dt.UTC)
    with pytest.raises(TaskDeferred) as deferred:
        op.execute(CONTEXT)

    assert deferred.value.method_name == "execute_after_lease_wait"
    assert deferred.value.kwargs == {"lease_waits": 1}
    _path, kwargs = deferred.value.trigger.serialize()  # a wake-up time, 45 s from now
    assert dt.timedelta(seconds=45) <= kwargs["moment"] - before < dt.timedelta(seconds=60)
    with pytest.raises(TaskDeferred) as again:  # resumed, still held: waits once more
        op.execute_after_lease_wait(CONTEXT, event=None, lease_waits=1)
    assert again.value.kwargs == {"lease_waits": 2}


def test_a_lease_still_held_after_the_last_wait_fails_the_try_for_a_retry(tmp_path):
    op = batch_task(tmp_path, ExitCode.LEASE_HELD, "pipeline 'p' is being run by 'other'",
                    lease_max_waits=2)  # fmt: skip

    with pytest.raises(AirflowException) as failed:
        op.execute_after_lease_wait(CONTEXT, lease_waits=2)

    assert not isinstance(failed.value, AirflowFailException)
    assert "is being run by 'other'" in str(failed.value)


def test_without_deferral_a_held_lease_fails_the_try_for_a_retry(tmp_path):
    op = batch_task(tmp_path, ExitCode.LEASE_HELD, "held", deferrable=False)

    with pytest.raises(AirflowException) as failed:
        op.execute(CONTEXT)

    assert not isinstance(failed.value, AirflowFailException)


@pytest.mark.parametrize(
    ("code", "message"),
    [
        (ExitCode.CONFIG_ERROR, "MICROBATCH_S3_BUCKET='ab': S3 bucket names need 3+ characters"),
        (ExitCode.DATA_LOSS, "Kafka deleted records its stored plan was to read"),
    ],
)
def test_config_errors_and_data_loss_fail_without_retries(tmp_path, code, message):
    op = batch_task(tmp_path, code, message)

    with pytest.raises(AirflowFailException) as failed:
        op.execute(CONTEXT)

    assert message in str(failed.value) and code.reason in str(failed.value)


@pytest.mark.parametrize("code", [ExitCode.SERVICE_UNREACHABLE, ExitCode.BATCH_FAILED])
def test_unreachable_services_and_failed_batches_are_retried(tmp_path, code):
    op = batch_task(tmp_path, code, "cannot connect to Kafka at b1:9092")

    with pytest.raises(AirflowException) as failed:
        op.execute(CONTEXT)

    assert not isinstance(failed.value, AirflowFailException)
    assert "cannot connect to Kafka at b1:9092" in str(failed.value)


def test_a_job_file_that_does_not_exist_is_a_config_error_before_any_process(tmp_path):
    op = MicrobatchBatchOperator(
        task_id="batch", job=str(tmp_path / "nope.py"), dry_run=True,
        kafka_conn_id=None, s3_conn_id=None, spark_conn_id=None,
    )  # fmt: skip

    with pytest.raises(AirflowFailException, match=r"nope\.py does not exist"):
        op.execute(CONTEXT)


def test_settings_refused_for_production_fail_the_task_without_retries(monkeypatch, tmp_path):
    monkeypatch.setenv("MICROBATCH_ENV", "production")  # with the local stack's defaults
    op = batch_task(tmp_path, ExitCode.OK, "never runs")

    with pytest.raises(AirflowFailException, match="refused with MICROBATCH_ENV=production"):
        op.execute(CONTEXT)
