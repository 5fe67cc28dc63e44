"""The batch task's arguments: the data interval is the batch, params fill the rest."""

from __future__ import annotations

import datetime as dt
from types import SimpleNamespace

from microbatch_airflow.operators import MicrobatchBatchOperator, interval_end

END = dt.datetime(2026, 1, 1, 0, 5, tzinfo=dt.UTC)


def test_until_is_the_data_interval_end_else_the_logical_date_else_the_trigger_time():
    later = END + dt.timedelta(minutes=1)

    assert interval_end({"data_interval_end": END, "logical_date": later}) == END.isoformat()
    assert interval_end({"data_interval_end": None, "logical_date": later}) == later.isoformat()
    run = SimpleNamespace(run_after=later)
    assert interval_end({"logical_date": None, "dag_run": run}) == later.isoformat()


def test_params_fill_what_the_operator_leaves_open():
    op = MicrobatchBatchOperator(task_id="batch", job="jobs/clickstream.py", max_records=10,
                                 run_id="clickstream/manual__1")  # fmt: skip
    context = {
        "data_interval_end": END,
        "params": {"parallelism": 4, "max_records": None, "dry_run": True},
    }

    args, dry_run = op.batch_args(context)

    assert dry_run is True
    assert args == ["--until", END.isoformat(), "--run-id", "clickstream/manual__1",
                    "--parallelism", "4", "--max-records", "10", "--dry-run"]  # fmt: skip


def test_default_run_id_is_templated_per_dag_run():
    op = MicrobatchBatchOperator(task_id="batch", job="jobs/clickstream.py")

    assert op.run_id == "{{ dag.dag_id }}/{{ run_id }}"
    assert "run_id" in op.template_fields and "until" in op.template_fields


def test_a_backfill_run_reprocesses_its_interval_and_a_scheduled_run_only_records_it():
    from airflow.utils.types import DagRunType

    start = END - dt.timedelta(minutes=5)
    op = MicrobatchBatchOperator(task_id="batch", job="jobs/clickstream.py", run_id="r",
                                 kafka_repeats_on_backfill=True)  # fmt: skip
    interval = {"data_interval_start": start, "data_interval_end": END, "params": {}}

    backfill = {**interval, "dag_run": SimpleNamespace(run_type=DagRunType.BACKFILL_JOB)}
    args, _ = op.batch_args(backfill)
    assert args == ["--interval-start", start.isoformat(), "--until", END.isoformat(),
                    "--backfill", "--accept-kafka-repeats", "--run-id", "r"]  # fmt: skip

    scheduled = {**interval, "dag_run": SimpleNamespace(run_type=DagRunType.SCHEDULED)}
    args, _ = op.batch_args(scheduled)
    assert "--backfill" not in args and args[:2] == ["--interval-start", start.isoformat()]


def test_a_cron_schedule_gets_data_intervals_so_backfills_know_where_to_start():
    from microbatch_airflow.dag_factory import microbatch_dag

    dag = microbatch_dag("unit_intervals", "jobs/clickstream.py", schedule="*/5 * * * *",
                         max_parallelism=8, default_parallelism=2)  # fmt: skip

    assert type(dag.timetable).__name__ == "CronDataIntervalTimetable"  # not a bare trigger
    assert (
        microbatch_dag(
            "unit_once",
            "jobs/clickstream.py",
            schedule="@once",
            max_parallelism=8,
            default_parallelism=2,
        ).timetable.__class__.__name__
        == "OnceTimetable"
    )


def test_batches_wait_for_the_previous_interval_so_backfills_run_in_order():
    from microbatch_airflow.dag_factory import microbatch_dag

    dag = microbatch_dag("unit_order", "jobs/clickstream.py", max_parallelism=8,
                         default_parallelism=2)  # fmt: skip

    assert dag.get_task("batch").depends_on_past is True
    assert dag.get_task("new_data").depends_on_past is False  # the check itself never waits


def test_a_backfill_run_is_never_skipped_as_idle():
    from airflow.utils.types import DagRunType

    from microbatch_airflow.operators import MicrobatchNewDataOperator

    op = MicrobatchNewDataOperator(task_id="new_data", job="/nonexistent/job.py")
    run = SimpleNamespace(run_type=DagRunType.BACKFILL_JOB)

    # The pipeline has read these records already: the check must not even look.
    assert op.execute({"dag_run": run, "params": {}}) == {"status": "new_data",
                                                          "message": "backfill"}  # fmt: skip


def test_load_job_pipeline_uses_the_task_settings_and_env_without_touching_os_environ(
    monkeypatch,
):
    import os
    from pathlib import Path

    from microbatch.settings import Settings
    from microbatch_airflow.operators import load_job_pipeline

    monkeypatch.setenv("MICROBATCH_CLICKSTREAM_TOPIC", "clicks-of-the-process")
    monkeypatch.setenv("MICROBATCH_CLICKSTREAM_PARALLELISM", "4")
    before = dict(os.environ)
    job = str(Path(__file__).resolve().parents[3] / "jobs" / "clickstream.py")
    settings = Settings.from_env(env={}, s3_bucket="task-bucket")

    pipeline = load_job_pipeline(job, settings, {"MICROBATCH_CLICKSTREAM_TOPIC": "task-clicks"})

    assert pipeline.source.topics == ("task-clicks",)  # the task's env wins
    assert pipeline.parallelism == 4  # the process's environment still applies
    assert pipeline.checkpoints == "s3://task-bucket/clickstream/checkpoints"
    assert dict(os.environ) == before
