"""The CLI's contract with its callers: one exit code per cause, and errors as JSON."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from botocore.exceptions import ClientError, EndpointConnectionError, NoCredentialsError
from kafka.errors import KafkaConnectionError, KafkaTimeoutError

from microbatch.cli import main
from microbatch.errors import (
    BatchError,
    CheckpointError,
    ConfigError,
    DataLossError,
    ExitCode,
    LeaseError,
    ServiceError,
    SinkError,
    SourceError,
    StorageError,
    exit_code,
)
from microbatch.runtime.fence import FencedError

JOB = """
from tests.integration.runtime.pipelines import count_pipeline
pipeline = count_pipeline("clicks", {root!r})
"""


def _raised_from(error: Exception, cause: BaseException) -> Exception:
    try:
        raise error from cause
    except Exception as e:
        return e


def _s3_error(code: str, status: int) -> ClientError:
    body = {
        "Error": {"Code": code, "Message": code},
        "ResponseMetadata": {"HTTPStatusCode": status},
    }
    return ClientError(body, "GetObject")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("error", "code"),
    [
        (ConfigError("MICROBATCH_S3_BUCKET='ab'"), ExitCode.CONFIG_ERROR),
        (LeaseError("pipeline 'p' is being run by 'other'"), ExitCode.LEASE_HELD),
        (FencedError("pipeline 'p': run 'a' lost the lease"), ExitCode.LEASE_HELD),
        (DataLossError("clicks[0]: offset 3 is no longer available"), ExitCode.DATA_LOSS),
        (ServiceError("SeaweedFS did not start"), ExitCode.SERVICE_UNREACHABLE),
        (BatchError("120 of 500 records went to the dead letters"), ExitCode.BATCH_FAILED),
        (SourceError("two ranges for clicks[0]"), ExitCode.BATCH_FAILED),
        (CheckpointError("checkpoint 4 is corrupt"), ExitCode.BATCH_FAILED),
        (SinkError("sink 'counts' failed"), ExitCode.BATCH_FAILED),
        (RuntimeError("the pipeline's own bug"), ExitCode.BATCH_FAILED),
    ],
)
def test_each_error_class_maps_to_its_exit_code(error, code):
    assert exit_code(error) is code


@pytest.mark.parametrize(
    ("error", "cause", "code"),
    [
        (
            StorageError("S3 get of key lease.json failed"),
            EndpointConnectionError(endpoint_url="http://127.0.0.1:1"),
            ExitCode.SERVICE_UNREACHABLE,
        ),
        (
            SourceError("cannot connect to Kafka at 127.0.0.1:1"),
            KafkaTimeoutError("Unable to bootstrap from 127.0.0.1:1"),
            ExitCode.SERVICE_UNREACHABLE,
        ),
        (
            SinkError("producer failed"),
            KafkaConnectionError("refused"),
            ExitCode.SERVICE_UNREACHABLE,
        ),
        (
            StorageError("get failed"),
            ConnectionRefusedError(111, "refused"),
            ExitCode.SERVICE_UNREACHABLE,
        ),
        (
            StorageError("S3 get failed"),
            _s3_error("InvalidAccessKeyId", 403),
            ExitCode.CONFIG_ERROR,
        ),
        (StorageError("S3 put failed"), NoCredentialsError(), ExitCode.CONFIG_ERROR),
        (StorageError("S3 put failed"), _s3_error("InternalError", 500), ExitCode.BATCH_FAILED),
    ],
)
def test_a_failed_connection_or_refused_credentials_decide_by_the_cause(error, cause, code):
    assert exit_code(_raised_from(error, cause)) is code


def test_a_library_error_spark_passes_back_as_text_maps_by_the_class_it_names():
    # What a failed Spark task looks like on the driver: the worker's traceback as text.
    text = (
        "Job aborted due to stage failure: Task 0 in stage 3.0 failed 1 times\n"
        "Traceback (most recent call last):\n"
        "kafka.errors.OffsetOutOfRangeError: [Error 1] OffsetOutOfRangeError\n"
        "The above exception was the direct cause of the following exception:\n"
        "microbatch.errors.DataLossError: reading clicks[0] [3, 9): offset 3 is no longer "
        "available\n\tat org.apache.spark.api.python.BasePythonRunner"
    )

    assert exit_code(RuntimeError(text)) is ExitCode.DATA_LOSS
    assert exit_code(RuntimeError("microbatch.errors.NoSuchError: x")) is ExitCode.BATCH_FAILED


def spark_task_failure(*lines: str) -> RuntimeError:
    """A Spark task's failure as the driver gets it: Py4J/PythonException text around the
    worker's traceback."""
    return RuntimeError(
        "An error occurred while calling o84.collectToPython.\n"
        ": org.apache.spark.SparkException: Job aborted due to stage failure: Task 1 in "
        "stage 2.0 failed 1 times, most recent failure: Lost task 1.0 in stage 2.0: "
        "org.apache.spark.api.python.PythonException: Traceback (most recent call last):\n"
        + "\n".join(lines)
        + "\n\tat org.apache.spark.api.python.BasePythonRunner$ReaderIterator.handlePythonException"
    )


S3_DOWN = 'Could not connect to the endpoint URL: "http://127.0.0.1:8333/mb/counts/part-1.parquet"'


@pytest.mark.parametrize(
    "failure",
    [
        spark_task_failure(
            f"botocore.exceptions.EndpointConnectionError: {S3_DOWN}",
            "The above exception was the direct cause of the following exception:",
            "microbatch.errors.StorageError: S3 put of key counts/part-1.parquet in bucket 'mb' "
            f"failed after 6 attempt(s): {S3_DOWN}",
        ),
        # Only the library's own line came through (a shortened message).
        spark_task_failure(
            "microbatch.errors.StorageError: S3 put of key counts/part-1.parquet in bucket 'mb' "
            f"failed after 6 attempt(s): {S3_DOWN}"
        ),
        spark_task_failure(
            "ConnectionRefusedError: [Errno 111] Connection refused",
            "microbatch.errors.StorageError: get failed",
        ),
    ],
)
def test_s3_unreachable_in_a_spark_task_exits_as_on_the_driver(failure):
    on_the_driver = _raised_from(
        StorageError(f"S3 put of key counts/part-1.parquet failed after 6 attempt(s): {S3_DOWN}"),
        EndpointConnectionError(endpoint_url="http://127.0.0.1:8333"),
    )

    assert exit_code(failure) is exit_code(on_the_driver) is ExitCode.SERVICE_UNREACHABLE


@pytest.mark.parametrize(
    "failure",
    [
        spark_task_failure(
            "microbatch.errors.StorageError: S3 put of key counts/part-1.parquet in bucket 'mb' "
            "failed: An error occurred (InvalidAccessKeyId) when calling the PutObject "
            "operation: The AWS Access Key Id you provided does not exist in our records."
        ),
        spark_task_failure(
            "botocore.exceptions.NoCredentialsError: Unable to locate credentials",
            "The above exception was the direct cause of the following exception:",
            "microbatch.errors.StorageError: S3 get of key plans/1.json failed",
        ),
        spark_task_failure(
            "kafka.errors.SaslAuthenticationFailedError: [Error 58] authentication failed",
            "microbatch.errors.SourceError: reading clicks[0] [3, 9) failed",
        ),
    ],
)
def test_credentials_refused_in_a_spark_task_exit_as_on_the_driver(failure):
    assert exit_code(failure) is ExitCode.CONFIG_ERROR


def test_a_spark_task_failure_of_a_reachable_store_still_exits_batch_failed():
    failure = spark_task_failure(
        "microbatch.errors.StorageError: S3 put of key counts/part-1.parquet in bucket 'mb' "
        "failed after 6 attempt(s): An error occurred (InternalError) when calling PutObject"
    )
    unrelated = RuntimeError(f"the pipeline's own bug, {S3_DOWN} mentioned in passing")

    assert exit_code(failure) is ExitCode.BATCH_FAILED
    assert exit_code(unrelated) is ExitCode.BATCH_FAILED  # no library error named


def test_exit_codes_and_reasons_are_distinct_and_stable():
    assert {c.name: int(c) for c in ExitCode} == {
        "OK": 0,
        "BATCH_FAILED": 1,
        "CONFIG_ERROR": 2,
        "LEASE_HELD": 3,
        "SERVICE_UNREACHABLE": 4,
        "DATA_LOSS": 5,
        "NOT_FOUND": 6,
    }
    assert ExitCode.LEASE_HELD.reason == "lease_held"
    assert ExitCode.of_status(3) is ExitCode.LEASE_HELD
    assert ExitCode.of_status(-9) is ExitCode.BATCH_FAILED  # killed by a signal
    assert ExitCode.of_status(137) is ExitCode.BATCH_FAILED


def test_json_error_is_one_object_on_stdout_with_reason_message_and_code(tmp_path, capsys):
    missing = tmp_path / "missing.py"

    assert main(["status", str(missing), "--json"]) == 2

    out, err = capsys.readouterr()
    assert json.loads(out) == {
        "error": {
            "reason": "config_error",
            "message": f"pipeline file {str(missing)!r} does not exist",
            "exit_code": 2,
        }
    }
    assert err.strip() == f"microbatch status: pipeline file {str(missing)!r} does not exist"


def test_without_json_an_error_is_one_line_on_stderr_and_nothing_on_stdout(tmp_path, capsys):
    assert main(["status", str(tmp_path / "missing.py")]) == 2

    out, err = capsys.readouterr()
    assert out == ""
    assert err.startswith("microbatch status: pipeline file") and err.count("\n") == 1


def test_a_usage_error_exits_2_and_is_json_with_json(capsys):
    assert main(["run", "jobs/x.py", "--parallelism", "many", "--json"]) == 2

    error = json.loads(capsys.readouterr().out)["error"]
    assert error["reason"] == "config_error" and error["exit_code"] == 2
    assert "--parallelism: invalid int value: 'many'" in error["message"]
    assert "usage: microbatch run" in error["message"]


def test_a_batch_refused_because_another_run_holds_the_lease_exits_3(tmp_path: Path, capsys):
    from microbatch.runtime import fence
    from microbatch.storage import open_store

    job = tmp_path / "job.py"
    job.write_text(JOB.format(root=str(tmp_path)))
    store = open_store(str(tmp_path / "checkpoints"))
    held = fence.acquire(store, "counts", "scheduled__2026-11-25T10:00", timeout_s=600)
    try:
        assert main(["run", str(job), "--json"]) == ExitCode.LEASE_HELD
    finally:
        held.release()

    error = json.loads(capsys.readouterr().out)["error"]
    assert error["reason"] == "lease_held" and error["exit_code"] == 3
    assert "is being run by 'scheduled__2026-11-25T10:00'" in error["message"]
