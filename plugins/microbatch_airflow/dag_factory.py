"""Declare a pipeline's DAG in a few lines: ``microbatch_dag("clickstream", "jobs/x.py")``.

The DAG runs one micro-batch per run::

    new_data (MicrobatchNewDataOperator) ──► batch (MicrobatchBatchOperator) ──► asset event

- one run at a time (``max_active_runs=1``), no catch-up by default: a batch reads up to
  the end of its run's data interval, and a late run simply reads more;
- ``schedule="on_new_data"`` makes the DAG event-driven: a run starts when the pipeline's
  topics hold records past its newest checkpoint (an asset watched by
  :class:`~microbatch_airflow.triggers.NewRecordsTrigger` in the triggerer, polling every
  ``new_data_poll_s``); ``on_new_data=True`` with a cron ``schedule`` does both (the cron
  runs also fire event-time timers once records stop arriving, and keep backfills
  possible). A duplicate, stale or late event never duplicates output: a run reads
  exactly the offsets past the newest checkpoint, and skips its batch when there are none;
- a cron ``schedule`` gets real data intervals (``CronDataIntervalTimetable``: the run at
  10:05 covers ``[10:00, 10:05)``), so ``airflow backfill create`` can reprocess past
  intervals: each backfill run rewinds the pipeline to the checkpoint as of its interval's
  start when the pipeline has gone past it (``docs/airflow.md``, "Backfill");
- retries with exponential backoff; a retry of a run reuses its run id, so it takes over
  the pipeline's lease and replays the plan the failed attempt stored;
- the batch task ``depends_on_past``: batches run in data-interval order, also within a
  backfill (Airflow then refuses ``--run-backwards`` and needs ``--reprocess-behavior``
  ``completed`` or ``failed``);
- trigger-form params ``parallelism``, ``max_records``, ``dry_run``
  (:mod:`microbatch_airflow.params`);
- ``skip_when_idle=True``: the batch is skipped when no record is new and no event-time
  timer can fire (:mod:`microbatch_airflow.freshness`);
- the batch task's outlet is the pipeline's asset ``microbatch://<pipeline>``.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from microbatch_airflow.connections import (
    KAFKA_CONN_ID,
    POSTGRES_CONN_ID,
    S3_CONN_ID,
    SPARK_CONN_ID,
)

DEFAULT_START = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
#: ``microbatch_dag(schedule=ON_NEW_DATA)``: event-driven runs only.
ON_NEW_DATA = "on_new_data"


def microbatch_dag(
    dag_id: str,
    job: str | Path,
    *,
    pipeline: str | None = None,
    schedule: Any = "*/5 * * * *",
    start_date: dt.datetime = DEFAULT_START,
    max_parallelism: int,
    default_parallelism: int,
    retries: int = 2,
    retry_delay: dt.timedelta = dt.timedelta(seconds=30),
    retry_exponential_backoff: float = 2.0,
    max_retry_delay: dt.timedelta = dt.timedelta(minutes=10),
    catchup: bool = False,
    env: Mapping[str, str] | None = None,
    skip_when_idle: bool = True,
    wait_for_data_s: float = 0.0,
    deferrable: bool = True,
    execution_timeout: dt.timedelta | None = dt.timedelta(hours=1),
    kafka_conn_id: str | None = KAFKA_CONN_ID,
    s3_conn_id: str | None = S3_CONN_ID,
    spark_conn_id: str | None = SPARK_CONN_ID,
    postgres_conn_id: str | None = POSTGRES_CONN_ID,
    tags: Sequence[str] = (),
    doc_md: str | None = None,
    kafka_repeats_on_backfill: bool = False,
    on_new_data: bool = False,
    new_data_poll_s: float = 2.0,
    **dag_kwargs: Any,
) -> Any:
    """Build (and register) the DAG of the pipeline in ``job``.

    ``pipeline`` names the asset (default: the job file's stem; it should equal the
    pipeline's ``name``). ``max_parallelism`` bounds the ``parallelism`` param (use the
    pipeline's own ``max_parallelism``); ``default_parallelism`` is its default. ``env``
    is extra environment for the job (``MICROBATCH_<PIPELINE>_*`` configuration, never
    secrets: use connections). ``wait_for_data_s`` lets the new-data check wait in the
    triggerer for records to arrive before skipping. ``kafka_repeats_on_backfill`` lets
    backfills of a pipeline with Kafka sinks publish the reprocessed intervals' records
    again (without it such a backfill is refused). ``schedule="on_new_data"`` (or
    ``on_new_data=True`` beside a cron) starts runs when records arrive, checking every
    ``new_data_poll_s`` seconds. Other keyword arguments go to ``DAG``.
    """
    from airflow.sdk import DAG

    from microbatch_airflow.assets import new_records_asset, outputs_alias, pipeline_asset
    from microbatch_airflow.operators import MicrobatchBatchOperator, MicrobatchNewDataOperator
    from microbatch_airflow.params import batch_params
    from microbatch_airflow.triggers import NewRecordsTrigger

    job = str(Path(job).resolve())
    pipeline = pipeline or Path(job).stem
    env = dict(env or {})
    if schedule == ON_NEW_DATA:
        schedule, on_new_data = None, True
    timetable = _with_data_intervals(schedule)
    if on_new_data:
        watched = new_records_asset(
            pipeline,
            NewRecordsTrigger(job, env=env, kafka_conn_id=kafka_conn_id, s3_conn_id=s3_conn_id,
                              poll_interval_s=new_data_poll_s),
        )  # fmt: skip
        timetable = _or_on(watched, timetable)
    default_args = {
        "retries": retries,
        "retry_delay": retry_delay,
        "retry_exponential_backoff": retry_exponential_backoff,
        "max_retry_delay": max_retry_delay,
        "execution_timeout": execution_timeout,
    }
    with DAG(
        dag_id=dag_id,
        schedule=timetable,
        start_date=start_date,
        catchup=catchup,
        max_active_runs=dag_kwargs.pop("max_active_runs", 1),
        params=batch_params(max_parallelism, default_parallelism),
        default_args={**default_args, **dag_kwargs.pop("default_args", {})},
        tags=sorted({"microbatch", pipeline, *tags}),
        doc_md=doc_md or _doc(pipeline, job),
        **dag_kwargs,
    ) as dag:
        check = MicrobatchNewDataOperator(
            task_id="new_data",
            job=job,
            env=env,
            skip_when_idle=skip_when_idle,
            deferrable=deferrable,
            wait_s=wait_for_data_s,
            kafka_conn_id=kafka_conn_id,
            s3_conn_id=s3_conn_id,
        )
        batch = MicrobatchBatchOperator(
            task_id="batch",
            job=job,
            env=env,
            outlets=[pipeline_asset(pipeline), outputs_alias(pipeline)],
            kafka_repeats_on_backfill=kafka_repeats_on_backfill,
            deferrable=deferrable,  # waits for another run's lease in the triggerer
            # Batches are ordered: a run's batch waits for the previous run's (succeeded or
            # skipped). It also orders a backfill's runs, whatever its --max-active-runs.
            depends_on_past=True,
            kafka_conn_id=kafka_conn_id,
            s3_conn_id=s3_conn_id,
            spark_conn_id=spark_conn_id,
            postgres_conn_id=postgres_conn_id,
        )
        check >> batch
    return dag


def _with_data_intervals(schedule: Any) -> Any:
    """A cron expression as a timetable whose runs cover ``[previous tick, tick)``.

    Airflow 3 runs a bare cron string at its ticks with an empty data interval; a batch
    needs the interval's start to know where a backfill starts."""
    if not isinstance(schedule, str) or schedule in ("@once", "@continuous"):
        return schedule
    from airflow.sdk.definitions.timetables.interval import CronDataIntervalTimetable

    return CronDataIntervalTimetable(schedule, timezone="UTC")


def _or_on(asset: Any, timetable: Any) -> Any:
    """Runs on ``asset``'s events, and also at ``timetable``'s ticks when there is one."""
    if timetable is None:
        return asset
    if isinstance(timetable, str):  # "@once", "@continuous": no ticks to combine with
        from microbatch.errors import ConfigError

        raise ConfigError(f"schedule={timetable!r} cannot be combined with on_new_data=True")
    from airflow.sdk import AssetOrTimeSchedule

    return AssetOrTimeSchedule(timetable=timetable, assets=asset)


def _doc(pipeline: str, job: str) -> str:
    return (
        f"Micro-batches of pipeline **{pipeline}** (`{Path(job).name}`): each run reads the "
        "Kafka records of its data interval and commits one checkpoint. Trigger with "
        "*parallelism*, *max_records* or *dry_run* (plan only). See `docs/airflow.md`."
    )
