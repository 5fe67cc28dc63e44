"""One micro-batch = one checkpoint: the commit protocol, top to bottom.

:meth:`BatchRunner.run` takes these steps in order, each a method below (crash points are
named in :mod:`.faults`; where a crashed batch stands is :mod:`.phases`):

0. **Fence** — take the pipeline's lease (:mod:`.fence`): a second run fails fast.
1. **Recover** — if the newest checkpoint is COMMITTED but not PUBLISHED (a crash after
   the commit), publish it now; publishing is idempotent. A backfill of an interval the
   pipeline went past first rewinds to the checkpoint that ended there (:mod:`.replay`).
2. **Plan** — a batch already PLANNED (an earlier attempt stored its plan) replays it, at
   the parallelism it recorded; else plan the offset ranges (to the data interval's end,
   within the limits) and store the plan *before* any work.
3. **Execute** — one Spark job (:mod:`.execute`): stage 1 reads, decodes, enriches and
   keys; stage 2 restores each instance's key-groups, processes, fires timers, writes
   state and stages sink output. Each instance returns an :class:`InstanceResult`.
4. **Commit** — create the manifest (exclusive create) holding the :class:`BatchRecord`:
   offsets of every partition, key-group index, watermark, staged output, stats. The
   single commit point.
5. **Publish** — make the staged output visible, mirror the offsets (:mod:`.publish`).
6. **GC** — retention of checkpoints and per-batch objects (:mod:`.retention`).

A crash anywhere, then a rerun, gives the outputs and state of a run without the crash.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Callable, Sequence
from typing import Any, cast

from microbatch.checkpoint import (
    Layout,
    Manifest,
    build_manifest,
    commit_manifest,
    latest_manifest,
    list_checkpoints,
    load_manifest,
)
from microbatch.errors import BatchError, CheckpointError, ConfigError
from microbatch.kafka import (
    BatchPlan,
    BrokerView,
    KafkaBrokerView,
    PlanStore,
    partition_lag,
    snapshot_to_json,
)
from microbatch.runtime import fence, replay
from microbatch.runtime.execute import Executor, SparkExecutor, check_storage_for_master
from microbatch.runtime.faults import check_crash_point, crash_if, pause_if
from microbatch.runtime.fence import Lease
from microbatch.runtime.lineage import check_lineage, check_sinks_start_fresh, dropped_steps
from microbatch.runtime.options import BatchOptions, BatchResult, Laps, RunSpec, record_run_spec
from microbatch.runtime.outcome import (
    agreed_stage_one,
    batch_stats,
    check_dead_letters,
    staged_by_sink,
    with_seconds,
)
from microbatch.runtime.pending import load_pending, save_pending
from microbatch.runtime.pipeline import Pipeline, check_parallelism_for
from microbatch.runtime.planning import next_plan
from microbatch.runtime.publish import publish, recover
from microbatch.runtime.records import (
    BatchInfo,
    BatchRecord,
)
from microbatch.runtime.retention import collect_batch_garbage
from microbatch.runtime.rewind import RewindTarget, find_rewind_target
from microbatch.runtime.stage_two import StageTwo
from microbatch.runtime.watermark import WatermarkState, partition_name
from microbatch.settings import Settings
from microbatch.sinks.replacement import after_batch
from microbatch.storage import ObjectStore, open_store

log = logging.getLogger(__name__)


class BatchRunner:
    """Runs batches of one pipeline (driver side): the protocol's steps.

    ``spark`` is a SparkSession, or a function returning one that is called only when a
    batch executes: a dry run, a recovery or a replay never starts Spark. ``executor`` and
    ``broker`` stand in for Spark and the source's brokers (tests of the protocol)."""

    def __init__(
        self,
        spark: Any | Callable[[], Any] | None,
        pipeline: Pipeline,
        settings: Settings,
        *,
        executor: Executor | None = None,
        broker: BrokerView | None = None,
    ) -> None:
        self.pipeline = pipeline
        self.settings = settings
        self.store: ObjectStore = open_store(pipeline.checkpoints, settings)
        self.layout = Layout()
        self.plans = PlanStore(self.store)
        self._broker: BrokerView | None = broker
        #: Offsets are mirrored to the pipeline's consumer group only on real brokers.
        self._kafka = broker is None
        check_storage_for_master(pipeline, settings.spark_master)
        self.executor = executor or SparkExecutor(spark, pipeline, settings, self.broker)
        #: The reader of the last executed batch: "spark" (the JVM Kafka source),
        #: "python" (kafka-python) or None (nothing to read).
        self.stage_one_reader: str | None = None

    @property
    def name(self) -> str:
        return self.pipeline.name

    def run(self, options: BatchOptions = BatchOptions()) -> BatchResult:
        crash_at = check_crash_point(options.crash_at)
        owner = options.run_id or f"cli-{uuid.uuid4().hex[:12]}"
        try:
            # Step 0: fence.
            with fence.lease(self.store, self.name, owner, self.pipeline.lease_timeout_s) as held:
                return self._run(options, crash_at, held)
        finally:
            self.close_broker()

    def _run(self, options: BatchOptions, crash_at: str | None, held: Lease) -> BatchResult:
        laps = Laps()
        attempt = uuid.uuid4().hex[:12]  # in every name this attempt stages
        base, recovered = self.recover(held)  # Step 1
        if base is None:
            check_sinks_start_fresh(self.pipeline, self.settings, self.store.url)
        laps.lap("recover")
        rewind = None
        if options.backfill and options.interval_start_ms is not None:
            base, rewind = self.rewind_for_backfill(base, options, held)
            laps.lap("rewind")

        pause_if("before_plan", f"pipeline {self.name!r}")
        plan, spec, replayed = self.plan(base, options)  # Step 2
        where = f"pipeline {self.name!r} batch {plan.batch_id}"
        result = BatchResult(self.name, plan.batch_id, spec.parallelism, "dry_run", replayed)
        result.recovered_publish, result.rewind = recovered, rewind
        result.ranges = [
            {"topic": r.topic, "partition": r.partition, "from": r.start, "until": r.end}
            for r in plan.ranges
        ]
        laps.lap("plan")
        crash_if(crash_at, "after_plan", where)
        pause_if("after_plan", where)
        if options.dry_run:
            result.lag, result.seconds = self.lag(plan.start_offsets), laps.seconds
            return result

        self.executor.prepare()  # Spark starts here if it has not yet
        laps.lap("spark")
        record, snapshots, steps = self.execute(  # Step 3
            base, plan, spec, replayed, options, crash_at, attempt
        )
        laps.lap("execute")
        crash_if(crash_at, "after_sink_staging", where)
        check_dead_letters(self.pipeline, where, record)

        record = with_seconds(record, {**laps.seconds, "to_commit": laps.since_start()})
        pause_if("before_commit", where)
        held.check("the commit")
        manifest = self.commit(where, base, plan.batch_id, record, snapshots, steps)  # Step 4
        laps.lap("commit")
        crash_if(crash_at, "after_commit", where)

        pause_if("before_publish", where)
        held.check("publishing")
        self.publish(manifest, crash_at)
        laps.lap("publish")  # Step 5

        held.check("GC")
        collect_batch_garbage(
            self.store, self.layout, self.pipeline.retain_checkpoints, self.collect_orphans
        )
        laps.lap("gc")  # Step 6
        laps.seconds["total"] = laps.since_start()

        every = [*snapshots, *(s for snaps in steps.values() for s in snaps)]
        result.committed(record, every, self.pipeline.dead_letters)
        result.lag = self.lag(record.offsets)
        result.seconds = laps.seconds
        log.info("%s committed: %s", where, json.dumps(result.to_json()))
        return result

    # Step 1 ---------------------------------------------------------------------------
    def recover(self, held: Lease) -> tuple[Manifest | None, int | None]:
        """The newest checkpoint, published; and its id if this run had to publish it."""
        base = latest_manifest(self.store, self.layout)
        check_lineage(self.pipeline, self.store.url, base)
        if base is None:
            return None, None
        published = recover(
            self.store, self.layout, self.pipeline, self.settings, base, held, self._kafka
        )
        return base, base.checkpoint_id if published else None

    def rewind_for_backfill(
        self, base: Manifest | None, options: BatchOptions, held: Lease
    ) -> tuple[Manifest | None, dict[str, Any] | None]:
        """A backfill past the pipeline's position rewinds to the interval's start."""
        assert options.interval_start_ms is not None
        target = find_rewind_target(
            self.name, base, options.interval_start_ms, self._load_if_retained
        )
        if target is None or base is None:
            return base, None
        rewind: dict[str, Any] = {
            "to_checkpoint": target.checkpoint_id,
            "undone": [target.undone_from, base.checkpoint_id],
        }
        if not options.dry_run:
            base = self.rewind(base, target, options.accept_kafka_repeats, held)
            rewind["checkpoint"] = base.checkpoint_id
        return base, rewind

    # Step 2 ---------------------------------------------------------------------------
    def plan(self, base: Manifest | None, options: BatchOptions) -> tuple[BatchPlan, RunSpec, bool]:
        """(plan, run spec, replayed): the stored plan of the next batch or a new one."""
        batch_id = 0 if base is None else base.checkpoint_id + 1
        committed = None if base is None else BatchRecord.of(base).offsets
        # PLANNED or EXECUTED: replay the stored plan (re-plan if Kafka lost its records).
        plan, replayed = next_plan(
            self.plans, self.broker(), self.pipeline, committed, batch_id, options
        )
        parallelism = check_parallelism_for(
            self.pipeline, options.parallelism or self.pipeline.parallelism
        )
        spec = record_run_spec(
            self.store, self.layout, self.name, RunSpec(batch_id, parallelism, options.run_id)
        )
        return plan, spec, replayed

    # Step 3 ---------------------------------------------------------------------------
    def execute(
        self,
        base: Manifest | None,
        plan: BatchPlan,
        spec: RunSpec,
        replayed: bool,
        options: BatchOptions,
        crash_at: str | None,
        attempt: str,
    ) -> tuple[BatchRecord, list[Any], dict[str, list[Any]]]:
        """Run the batch; its record (without the driver's seconds), the state snapshots
        of its first keyed step and those of the further steps by uid."""
        base_record = BatchRecord.of(base)
        dropped = dropped_steps(self.pipeline, base)
        if dropped:
            log.warning(
                "pipeline %s batch %s: dropping the state of keyed step(s) %s (drop_state)",
                self.name, plan.batch_id, ", ".join(sorted(dropped)),
            )  # fmt: skip
        event_time_before = base_record.event_time or WatermarkState()
        pending_in = load_pending(self.store, base_record.enrich_pending)
        stage = StageTwo(
            pipeline=self.pipeline,
            settings=self.settings,
            batch_id=plan.batch_id,
            parallelism=spec.parallelism,
            base_manifest=None if base is None else base.without_steps(dropped).to_json(),
            event_time=event_time_before.to_json(),
            processing_time_ms=plan.created_at,
            crash_at=crash_at,
            attempt=attempt,
        )
        self.stage_one_reader = None
        execution = self.executor.execute(plan, stage, pending_in, event_time_before.watermark)
        self.stage_one_reader = execution.reader
        totals, event_time = agreed_stage_one(
            f"pipeline {self.name!r} batch {plan.batch_id}",
            [*execution.results, *(r for rs in execution.steps.values() for r in rs)],
        )
        pending_out = (
            save_pending(self.store, self.layout, plan.batch_id, attempt, execution.results)
            if totals.pending
            else None
        )
        offsets = plan.end_offsets()
        supersedes, awaiting = after_batch(
            replay.awaiting_replacement(
                self.pipeline, self.settings, base_record if base else None
            ),
            {partition_name(*tp): n for tp, n in offsets.items()},
        )
        sinks = staged_by_sink(self.pipeline, execution.results)
        record = BatchRecord(
            offsets=offsets,
            batch=BatchInfo(
                parallelism=spec.parallelism,
                processing_time_ms=plan.created_at,
                until_timestamp_ms=plan.until_timestamp_ms,
                interval_start_ms=options.interval_start_ms,
                ends_exactly=plan.reaches_until is True,
                base_checkpoint=None if base is None else base.checkpoint_id,
                from_offsets=None if base else snapshot_to_json(plan.start_offsets),
                run_id=spec.run_id,
                replayed=replayed,
            ),
            event_time=event_time,
            watermark=event_time.watermark,
            enrich_pending=pending_out,
            sinks=sinks,
            supersedes=tuple(supersedes),
            awaiting_replacement=awaiting,
            stats=batch_stats(plan, execution, totals, pending_in, sinks),
        )
        steps = {uid: [r.snapshot for r in rs] for uid, rs in execution.steps.items()}
        return record, [r.snapshot for r in execution.results], steps

    # Step 4 ---------------------------------------------------------------------------
    def commit(
        self,
        where: str,
        base: Manifest | None,
        batch_id: int,
        record: BatchRecord,
        snapshots: list[Any],
        steps: dict[str, list[Any]] | None = None,
    ) -> Manifest:
        """Create the manifest of ``batch_id``, the checkpoint right after ``base``: only
        once (exclusive create), and never behind a newer checkpoint (a stalled attempt
        whose checkpoint id retention already removed cannot commit it again)."""
        newest = list_checkpoints(self.store, self.layout)
        expected = None if base is None else base.checkpoint_id
        if (newest[-1] if newest else None) != expected:
            raise BatchError(
                f"{where}: this attempt started from checkpoint {expected}, but the newest is "
                f"now {newest[-1] if newest else None}: another run went ahead, so this "
                "attempt is stale and commits nothing"
            )
        manifest = build_manifest(
            batch_id,
            snapshots,
            max_parallelism=self.pipeline.max_parallelism,
            pipeline_fingerprint=self.pipeline.fingerprint(),
            base=base,
            full=False,
            metadata=record.to_json(),
            operators=steps,
            step_types=self.pipeline.step_types(),
            first_uid=self.pipeline.uid,
        )
        try:
            commit_manifest(self.store, self.layout, manifest)
        except CheckpointError as e:
            raise BatchError(
                f"{where}: another run committed this batch first; this run's work is "
                f"discarded ({e})"
            ) from e
        return manifest

    # Step 5 ---------------------------------------------------------------------------
    def publish(self, manifest: Manifest, crash_at: str | None = None) -> None:
        publish(
            self.store, self.layout, self.pipeline, self.settings, manifest, crash_at, self._kafka
        )

    # Step 6 ---------------------------------------------------------------------------
    def collect_orphans(self, batches: Sequence[int]) -> None:
        """Before old batches leave retention: each sink drops what losing attempts left."""
        for sink in self.pipeline.all_sinks():
            n = sink.collect_orphans(self.settings, batches)
            if n:
                log.info(
                    "pipeline %s sink %s: deleted %d files of attempts that lost the commit "
                    "of batches %s..%s",
                    self.name,
                    sink.name,
                    n,
                    batches[0],
                    batches[-1],
                )

    # Replays (a rewind outside a backfill) --------------------------------------------
    def replay_from(
        self, checkpoint_id: int, *, run_id: str | None = None, accept_kafka_repeats: bool = False
    ) -> Manifest:
        """Roll the pipeline back to committed checkpoint ``checkpoint_id``.

        Commits a new checkpoint that is a copy of it (state, offsets, watermark, pending
        enrichment), so the next batches read again every record after it. Parquet output
        of the undone batches is replaced when those records are processed again; Kafka
        output cannot be taken back, so pipelines with Kafka sinks need
        ``accept_kafka_repeats``."""
        what = f"replaying from checkpoint {checkpoint_id}"
        replay.refuse_repeats(self.pipeline, what, accept_kafka_repeats)
        owner = run_id or f"replay-{uuid.uuid4().hex[:12]}"
        with fence.lease(self.store, self.name, owner, self.pipeline.lease_timeout_s) as held:
            latest, _ = self.recover(held)
            source = load_manifest(self.store, self.layout, checkpoint_id)
            if latest is None or checkpoint_id >= latest.checkpoint_id:
                raise ConfigError(
                    f"pipeline {self.name!r}: checkpoint {checkpoint_id} is the latest; "
                    "there is nothing to replay"
                )
            offsets = BatchRecord.of(source).offsets
            target = RewindTarget(source, offsets, checkpoint_id + 1)
            return self.rewind(latest, target, accept_kafka_repeats, held)

    def rewind(
        self, latest: Manifest, target: RewindTarget, accept_kafka_repeats: bool, held: Lease
    ) -> Manifest:
        return replay.rewind(
            self.store, self.layout, self.pipeline, self.settings, latest, target,
            accept_kafka_repeats, held,
        )  # fmt: skip

    # Kafka connections ----------------------------------------------------------------
    def lag(self, offsets: dict[Any, int] | Any) -> dict[str, int]:
        end = self.broker().end_offsets(list(offsets))
        return {str(tp): n for tp, n in partition_lag(end, offsets).items()}

    def broker(self) -> BrokerView:
        """One connection to the source's brokers per run (planning, then the lag after
        the commit): each new one costs a bootstrap and a metadata round trip."""
        if self._broker is None:
            self._broker = KafkaBrokerView.for_settings(self.settings)
        return self._broker

    def close_broker(self) -> None:
        if self._broker is not None and self._kafka:  # ours: a KafkaBrokerView
            cast(KafkaBrokerView, self._broker).close()
            self._broker = None

    def _load_if_retained(self, checkpoint_id: int) -> Manifest | None:
        if checkpoint_id < 0:
            return None
        try:
            return load_manifest(self.store, self.layout, checkpoint_id)
        except CheckpointError:
            return None


def run_batch(
    spark: Any, pipeline: Pipeline, settings: Settings, options: BatchOptions = BatchOptions()
) -> BatchResult:
    """Run the next batch of ``pipeline`` (see the module docstring)."""
    return BatchRunner(spark, pipeline, settings).run(options)
