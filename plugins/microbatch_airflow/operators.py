"""Operators: run a Spark job, run one micro-batch, skip a batch that has nothing to do.

A failed job is told apart by its exit code (the ``microbatch`` command's contract,
:class:`microbatch.errors.ExitCode`), never by its message:

=======================  ==========================================================
exit code                the task
=======================  ==========================================================
``config_error`` (2)     fails at once, no retry (:class:`AirflowFailException`)
``data_loss`` (5)        fails at once, no retry: the message says to rerun with
                         ``--replan`` or to set ``on_out_of_range='earliest'``
``lease_held`` (3)       another run holds the pipeline: the batch task waits in the
                         triggerer (``deferrable``) and tries again, up to
                         ``lease_max_waits`` times, then fails this try (retried)
``service_unreachable``  fails this try; Airflow retries it
(4), ``batch_failed``
(1), anything else
=======================  ==========================================================

Secrets (the S3 secret key, the Kafka SASL password, whichever source they come from) are
registered with Airflow's secret masker before the task's fields are rendered, so they are
replaced by ``***`` in task logs and in the rendered template fields.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping, Sequence
from typing import Any

from airflow.sdk import BaseOperator

from microbatch.errors import ExitCode, MicrobatchError, exit_code
from microbatch.settings import Settings
from microbatch_airflow.connections import (
    KAFKA_CONN_ID,
    POSTGRES_CONN_ID,
    S3_CONN_ID,
    SPARK_CONN_ID,
    settings_from_airflow,
)


class _UsesSettings:
    """The task's settings, from its connections and the environment, resolved once; their
    secrets are registered with the masker (by :func:`settings_from_airflow`) before any
    field is rendered or logged."""

    kafka_conn_id: str | None = None
    s3_conn_id: str | None = None
    spark_conn_id: str | None = None
    postgres_conn_id: str | None = None
    _settings: Settings | None = None

    def task_settings(self) -> Settings:
        """The settings (bad ones fail the task without retries: a config error)."""
        if self._settings is None:
            try:
                self._settings = settings_from_airflow(
                    self.kafka_conn_id,
                    self.s3_conn_id,
                    self.spark_conn_id,
                    self.postgres_conn_id,
                )
            except MicrobatchError as exc:
                raise task_failure(str(exc), exit_code(exc)) from None
        return self._settings

    def render_template_fields(self, context: Any, jinja_env: Any = None) -> None:
        self.task_settings()  # masks first: rendered fields are redacted when stored
        super().render_template_fields(context, jinja_env)  # type: ignore[misc]


def task_failure(message: str, code: ExitCode) -> Exception:
    """The exception a task fails with for a job that ended with ``code``: a retry cannot
    fix a configuration error or records Kafka deleted, so those fail without retries."""
    from airflow.sdk.exceptions import AirflowException, AirflowFailException

    if code in (ExitCode.CONFIG_ERROR, ExitCode.DATA_LOSS):
        return AirflowFailException(f"{message} [{code.reason}: not retried]")
    return AirflowException(f"{message} [{code.reason}]")


class _StopsItsJob(_UsesSettings):
    """Keeps the job's process so that a killed or timed-out task stops it (``on_kill``;
    ``run_job`` also stops it when the task's own code is interrupted), and reads the
    code it exited with."""

    _job_process: Any = None

    def _started(self, proc: Any) -> None:
        self._job_process = proc

    def on_kill(self) -> None:
        from microbatch.runner import stop_job

        if self._job_process is not None:
            stop_job(self._job_process)

    def job_exit_code(self, error: BaseException) -> ExitCode:
        """Why the job failed: the exit code of its process when it ran and exited non-zero,
        else (it never started: a missing job file, no spark-submit) ``error``'s own."""
        proc = self._job_process
        status = None if proc is None else proc.returncode
        if status:
            return ExitCode.of_status(status)
        return exit_code(error)


class MicrobatchJobOperator(_StopsItsJob, BaseOperator):
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
        postgres_conn_id: str | None = POSTGRES_CONN_ID,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.job = job
        self.job_args = list(job_args)
        self.kafka_conn_id = kafka_conn_id
        self.s3_conn_id = s3_conn_id
        self.spark_conn_id = spark_conn_id
        self.postgres_conn_id = postgres_conn_id

    def execute(self, context: Any) -> dict[str, Any]:
        from microbatch.runner import run_job

        settings = self.task_settings()
        self.log.info("microbatch settings: %s", settings.redacted())
        try:
            return run_job(
                self.job, self.job_args, settings, echo=self.log.info, started=self._started
            )
        except MicrobatchError as exc:
            raise task_failure(str(exc), self.job_exit_code(exc)) from None


class MicrobatchBatchOperator(_StopsItsJob, BaseOperator):
    """Run one micro-batch of the pipeline in ``job`` (a ``jobs/*.py`` entrypoint).

    The batch's arguments come from the operator, else from the run's params
    (``parallelism``, ``max_records``, ``dry_run``; see :mod:`microbatch_airflow.params`):

    - ``--until``: ``until`` if given (templated), else the run's ``data_interval_end``
      (for a manual run without one: its logical date, else when it was triggered), so a
      run's data interval is its batch;
    - ``--interval-start``: the run's ``data_interval_start`` (recorded in the checkpoint);
    - ``--backfill`` for runs of an ``airflow backfill``: the batch reprocesses its interval,
      first rewinding the pipeline to the checkpoint that ended at the interval's start if
      it has gone past it (``kafka_repeats_on_backfill`` adds ``--accept-kafka-repeats``,
      needed by pipelines with Kafka sinks, whose records are then published again);
    - ``--run-id``: ``{{ dag.dag_id }}/{{ run_id }}`` — a retry of the same run takes over
      the pipeline's lease and replays the plan the first attempt stored.

    The job's log streams into the task log; the batch result (``batch_id``,
    ``records_in``, ``outputs``, ``dead_letters``, ``watermark``, ``lag``, ``ranges``,
    ``seconds``, ``status``) is the XCom return value; a failed batch fails the task with
    the batch's own message, retried or not by its exit code (module docstring). A batch
    refused because another run holds the pipeline's lease waits ``lease_wait_s`` in the
    triggerer (``deferrable=True``; no worker slot held) and tries again, at most
    ``lease_max_waits`` times. A committed batch emits one event on each asset outlet
    (``extra``: :func:`microbatch_airflow.assets.asset_event_extra`); a dry run commits
    nothing, emits no event, and logs its offset ranges and lag.
    """

    template_fields: Sequence[str] = ("until", "run_id", "job_args", "env")
    ui_color = "#d7ecfb"
    _result: dict[str, Any] | None = None

    def __init__(
        self,
        *,
        job: str,
        until: str | None = None,
        run_id: str | None = "{{ dag.dag_id }}/{{ run_id }}",
        parallelism: int | None = None,
        max_records: int | None = None,
        dry_run: bool | None = None,
        kafka_repeats_on_backfill: bool = False,
        env: dict[str, str] | None = None,
        job_args: Sequence[str] = (),
        deferrable: bool = True,
        lease_wait_s: float = 30.0,
        lease_max_waits: int = 20,
        kafka_conn_id: str | None = KAFKA_CONN_ID,
        s3_conn_id: str | None = S3_CONN_ID,
        spark_conn_id: str | None = SPARK_CONN_ID,
        postgres_conn_id: str | None = POSTGRES_CONN_ID,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.job = job
        self.deferrable = deferrable
        self.lease_wait_s = lease_wait_s
        self.lease_max_waits = lease_max_waits
        self.until = until
        self.run_id = run_id
        self.parallelism = parallelism
        self.max_records = max_records
        self.dry_run = dry_run
        self.kafka_repeats_on_backfill = kafka_repeats_on_backfill
        self.env = dict(env or {})
        self.job_args = list(job_args)
        self.kafka_conn_id = kafka_conn_id
        self.s3_conn_id = s3_conn_id
        self.spark_conn_id = spark_conn_id
        self.postgres_conn_id = postgres_conn_id

    def batch_args(self, context: Any) -> tuple[list[str], bool]:
        from microbatch_airflow.params import batch_cli_args

        params = context.get("params") or {}

        def pick(own: Any, name: str) -> Any:
            return own if own is not None else params.get(name)

        dry_run = bool(pick(self.dry_run, "dry_run"))
        start = None if self.until else context.get("data_interval_start")
        args = batch_cli_args(
            until=self.until or interval_end(context),
            interval_start=None if start is None else start.isoformat(),
            backfill=is_backfill(context) and start is not None,
            accept_kafka_repeats=self.kafka_repeats_on_backfill,
            run_id=self.run_id,
            parallelism=pick(self.parallelism, "parallelism"),
            max_records=pick(self.max_records, "max_records"),
            dry_run=dry_run,
        )
        return [*args, *self.job_args], dry_run

    def execute(self, context: Any) -> dict[str, Any]:
        return self._run_batch(context, lease_waits=0)

    def execute_after_lease_wait(
        self, context: Any, event: Any = None, lease_waits: int = 0
    ) -> dict[str, Any]:
        """Resumed from the triggerer after waiting for another run's lease: try again."""
        return self._run_batch(context, lease_waits=lease_waits)

    def _run_batch(self, context: Any, lease_waits: int) -> dict[str, Any]:
        from airflow.sdk import Asset, AssetAlias

        from microbatch.runner import run_job
        from microbatch_airflow.assets import asset_event_extra, output_events

        settings = self.task_settings()
        self.log.info("microbatch settings: %s", settings.redacted())
        args, dry_run = self.batch_args(context)
        try:
            result = run_job(
                self.job, args, settings, self.log.info, env=self.env, started=self._started
            )
        except MicrobatchError as exc:
            code = self.job_exit_code(exc)
            if code is ExitCode.LEASE_HELD:
                self._wait_for_the_lease(exc, lease_waits)
            raise task_failure(str(exc), code) from None
        # The job's own line summed the batch up; what it read stays in the XCom value.
        for r in result.get("ranges", []):
            self.log.debug("  %s[%s] offsets [%s, %s)", r["topic"], r["partition"], r["from"],
                           r["until"])  # fmt: skip
        self.log.info("lag after the batch: %s", sum((result.get("lag") or {}).values()))
        self._result = result  # for the OpenLineage provider, asked when the task ends
        if dry_run or result.get("status") != "committed":
            self.log.info("dry run: nothing committed, no asset event")
            self.outlets = []  # the task's asset outlets get no event for this run
            return result
        for outlet in self.outlets:
            if isinstance(outlet, AssetAlias):  # the outputs' own URIs (assets.output_events)
                for uri, extra in output_events(result):
                    context["outlet_events"][outlet].add(Asset(uri=uri), extra=extra)
            else:
                context["outlet_events"][outlet].extra = asset_event_extra(result)
        return result

    def get_openlineage_facets_on_complete(self, task_instance: Any) -> Any:
        """The batch's lineage for Airflow's OpenLineage provider: the source topics in,
        the sinks out, the batch as a run facet (:mod:`microbatch_airflow.lineage`). Read
        from the result the job printed (this task's XCom when this operator object did
        not run the batch itself); the job file is never loaded here."""
        from microbatch_airflow.lineage import batch_lineage

        result = self._result
        if result is None and task_instance is not None:
            result = task_instance.xcom_pull(task_ids=task_instance.task_id)
        return batch_lineage(result)

    def _wait_for_the_lease(self, error: BaseException, lease_waits: int) -> None:
        """Defer to the triggerer for ``lease_wait_s``, then run the batch again; returns
        (the caller fails this try) when not deferrable or out of waits."""
        if not self.deferrable or lease_waits >= self.lease_max_waits:
            return
        from airflow.providers.standard.triggers.temporal import TimeDeltaTrigger

        self.log.warning(
            "another run holds the pipeline's lease; trying again in %.0f s (wait %d of %d): %s",
            self.lease_wait_s, lease_waits + 1, self.lease_max_waits, error,
        )  # fmt: skip
        self.defer(
            trigger=TimeDeltaTrigger(dt.timedelta(seconds=self.lease_wait_s)),
            method_name="execute_after_lease_wait",
            kwargs={"lease_waits": lease_waits + 1},
        )


def is_backfill(context: Any) -> bool:
    """Is this run part of an ``airflow backfill``? Its batch then reprocesses its data
    interval, rewinding the pipeline to the interval's start if it has gone past it."""
    run_type = getattr(context.get("dag_run"), "run_type", None)
    return str(getattr(run_type, "value", run_type)) == "backfill"


def interval_end(context: Any) -> str:
    """The batch's end: data interval end, else logical date, else trigger time, else now."""
    import datetime as dt

    for key in ("data_interval_end", "logical_date"):
        value = context.get(key)
        if value is not None:
            return value.isoformat()
    run = context.get("dag_run")
    run_after = getattr(run, "run_after", None)
    if run_after is not None:
        return run_after.isoformat()
    return dt.datetime.now(dt.UTC).isoformat()


class MicrobatchNewDataOperator(_UsesSettings, BaseOperator):
    """Skip the run's batch when the pipeline has nothing to do (``skip_when_idle``).

    Compares the Kafka end offsets with the offsets of the pipeline's newest checkpoint,
    and checks whether event-time timers could fire (see :mod:`microbatch_airflow.freshness`
    for the exact rules). No work → :class:`AirflowSkipException`, so the downstream batch
    task is skipped too; work → the decision is the XCom value. A dry run is never
    skipped (it is asked for to see the plan and the lag), nor is a backfill run (it
    reprocesses records the pipeline has already read).

    The check runs once in the task; when it finds nothing and ``wait_s`` > 0, the wait
    for data (polling every ``poll_interval_s``) is handed to :class:`NewDataTrigger` in
    the triggerer (``deferrable=True``, the default: no worker slot held) or done in the
    task. ``skip_when_idle=False`` turns the check off.
    """

    template_fields: Sequence[str] = ("env",)
    ui_color = "#eef6e8"

    def __init__(
        self,
        *,
        job: str,
        env: dict[str, str] | None = None,
        skip_when_idle: bool = True,
        deferrable: bool = True,
        wait_s: float = 0.0,
        poll_interval_s: float = 30.0,
        kafka_conn_id: str | None = KAFKA_CONN_ID,
        s3_conn_id: str | None = S3_CONN_ID,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.job = job
        self.env = dict(env or {})
        self.skip_when_idle = skip_when_idle
        self.deferrable = deferrable
        self.wait_s = wait_s
        self.poll_interval_s = poll_interval_s
        self.kafka_conn_id = kafka_conn_id
        self.s3_conn_id = s3_conn_id

    def execute(self, context: Any) -> dict[str, Any] | None:
        import time

        from microbatch_airflow.freshness import PipelineFacts, check_for_work
        from microbatch_airflow.triggers import NewDataTrigger

        if not self.skip_when_idle:
            self.log.info("skip_when_idle=False: the batch always runs")
            return {"status": "new_data", "message": "skip_when_idle is off"}
        if (context.get("params") or {}).get("dry_run"):
            self.log.info("dry run: the plan is wanted even without new data")
            return {"status": "new_data", "message": "dry run"}
        if is_backfill(context):
            self.log.info("backfill: the interval is reprocessed, whatever is new")
            return {"status": "new_data", "message": "backfill"}
        settings = self.task_settings()
        try:
            facts = PipelineFacts.from_pipeline(load_job_pipeline(self.job, settings, self.env))
            decision = check_for_work(facts, settings, int(time.time() * 1000))
        except MicrobatchError as exc:
            raise task_failure(str(exc), exit_code(exc)) from None
        if decision.event().get("status") != "idle" or self.wait_s <= 0:
            # Decided at once (one quick look at Kafka and the checkpoint): the triggerer
            # is only worth its round trip for waiting for data to arrive.
            return self.execute_complete(context, decision.event())
        if self.deferrable:
            self.defer(
                trigger=NewDataTrigger(
                    facts.to_json(),
                    kafka_conn_id=self.kafka_conn_id,
                    s3_conn_id=self.s3_conn_id,
                    wait_s=self.wait_s,
                    poll_interval_s=self.poll_interval_s,
                ),
                method_name="execute_complete",
            )
        deadline = time.monotonic() + self.wait_s
        while decision.event().get("status") == "idle" and time.monotonic() < deadline:
            time.sleep(min(self.poll_interval_s, max(0.0, deadline - time.monotonic())))
            decision = check_for_work(facts, settings, int(time.time() * 1000))
        return self.execute_complete(context, decision.event())

    def execute_complete(self, context: Any, event: dict[str, Any]) -> dict[str, Any]:
        from airflow.sdk.exceptions import AirflowException, AirflowSkipException

        status, message = event.get("status"), event.get("message", "")
        if status == "idle":
            raise AirflowSkipException(f"nothing to do: {message}")
        if status != "new_data":
            raise AirflowException(message or f"unexpected trigger event {event!r}")
        self.log.info("the batch runs: %s", message)
        return event


def load_job_pipeline(job: str, settings: Any, env: Mapping[str, str] | None = None) -> Any:
    """The Pipeline of ``job`` as its batch would build it: for the task's settings, in the
    environment the job's process gets (this one's, the settings', then the task's ``env``).
    """
    import os

    from microbatch.jobfile import load_pipeline

    return load_pipeline(job, settings, {**os.environ, **settings.to_env(), **(env or {})})
