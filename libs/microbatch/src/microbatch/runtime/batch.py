"""One micro-batch = one checkpoint: the commit protocol, step by step.

:func:`run_batch` runs, in order (each step a function below, each crash point named in
``microbatch.runtime.faults``):

0. **Fence** — take the pipeline's lease (a second run fails fast and clearly).
1. **Recover** — if the newest checkpoint was committed but its output not published (a
   crash after the commit), publish it now; publishing is idempotent.
2. **Plan** — reuse the stored plan of this batch if an earlier attempt wrote one (so a
   rerun reads the same records at the same parallelism); else plan the offset ranges
   (up to the data interval's end and the limits) and store the plan *before* any work.
3. **Execute** on Spark, one job — stage 1 (``mapInArrow``): read the exact ranges
   (Spark's JVM Kafka source or kafka-python), decode, enrich, key, route, and count
   (``stat`` rows, a copy for every instance). Stage 2 (``repartitionById`` on the
   instance, then ``mapInArrow`` over each whole partition; one task per instance
   without a shuffle when there is no input): every operator instance computes the
   batch watermark from the ``stat`` rows, restores its key-groups, processes its keys,
   fires timers, writes its state file and stages its sink output. Nothing is
   materialised between the stages: the shuffle is the only copy.
4. **Commit** — create the manifest (exclusive create): offsets of every partition,
   key-group index, watermark, staged output, stats. The single commit point.
5. **Publish** — make staged output visible (Parquet commit entries; one Kafka
   transaction per sink), mirror offsets to the pipeline's consumer group.
6. **GC** — retention of checkpoints, their plans and published staging.

A crash anywhere, then a rerun, gives the outputs and state of a run without the crash.
"""

from __future__ import annotations

import base64
import dataclasses
import datetime as dt
import io
import json
import logging
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.ipc as ipc

from microbatch.checkpoint import (
    Layout,
    Manifest,
    build_manifest,
    collect_garbage,
    commit_manifest,
    latest_manifest,
    load_manifest,
    should_write_full,
)
from microbatch.errors import BatchError, CheckpointError, ConfigError, MicrobatchError
from microbatch.kafka import (
    BatchLimits,
    BatchPlan,
    KafkaBrokerView,
    PlanStore,
    StartingPosition,
    TopicPartition,
    consumer_group_name,
    mirror_offsets,
    partition_lag,
    snapshot_from_json,
    snapshot_to_json,
)
from microbatch.kafka.reader import range_descriptors
from microbatch.kafka.spark_source import choose_reader, connector_problem, read_ranges_spark
from microbatch.runtime import fence
from microbatch.runtime.faults import check_crash_point, crash_if
from microbatch.runtime.keyed import RESULT_DDL, TICK, StageTwo
from microbatch.runtime.keyed import snapshot_from_json as snap_in
from microbatch.runtime.pipeline import (
    DEAD_LETTER_SINK,
    KafkaSink,
    Pipeline,
    check_parallelism_for,
)
from microbatch.runtime.records import (
    ENVELOPE_SCHEMA,
    SOURCE_COLUMNS,
    ReadingStageOne,
    StageOne,
)
from microbatch.runtime.rewind import RewindTarget, find_rewind_target
from microbatch.runtime.watermark import WatermarkState, partition_name
from microbatch.settings import Settings
from microbatch.sinks import kafka as kafka_sink
from microbatch.sinks import parquet as parquet_sink
from microbatch.storage import ObjectNotFoundError, ObjectStore, open_store

log = logging.getLogger(__name__)
SPEC_PREFIX = "batches/"


@dataclasses.dataclass(frozen=True)
class BatchOptions:
    """Per-run choices; None means "the pipeline's default".

    ``interval_start_ms``/``until_timestamp_ms`` are the run's data interval (recorded in
    the checkpoint). With ``backfill``, a pipeline that already went past the interval's
    start first rewinds to the checkpoint that ended there (:mod:`.rewind`), so the
    interval is processed again from the state it had then; ``accept_kafka_repeats``
    allows that for pipelines with Kafka sinks (their records are published again).
    """

    until_timestamp_ms: int | None = None
    interval_start_ms: int | None = None
    backfill: bool = False
    accept_kafka_repeats: bool = False
    parallelism: int | None = None
    max_records_per_batch: int | None = None
    dry_run: bool = False
    run_id: str | None = None
    crash_at: str | None = None


@dataclasses.dataclass
class BatchResult:
    """What a batch did; ``to_json()`` is what the CLI, XCom and the UI show."""

    pipeline: str
    batch_id: int
    parallelism: int
    status: str  # "committed" | "dry_run"
    replayed: bool = False
    records_in: int = 0
    dead_letters: int = 0
    dead_letter_reasons: dict[str, int] = dataclasses.field(default_factory=dict)
    outputs: dict[str, int] = dataclasses.field(default_factory=dict)
    watermark: int | None = None
    lag: dict[str, int] = dataclasses.field(default_factory=dict)
    ranges: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    recovered_publish: int | None = None
    rewind: dict[str, Any] | None = None
    state_bytes_written: int = 0
    seconds: dict[str, float] = dataclasses.field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def spec_key(batch_id: int) -> str:
    return f"{SPEC_PREFIX}{batch_id:020d}.json"


def _offsets(manifest: Manifest | None) -> dict[TopicPartition, int] | None:
    if manifest is None:
        return None
    return snapshot_from_json(manifest.metadata.get("offsets", {}))


def _starting(pipeline: Pipeline) -> StartingPosition:
    s = pipeline.source.starting
    if s == "earliest":
        return StartingPosition.earliest()
    if s == "latest":
        return StartingPosition.latest()
    return StartingPosition.timestamp(int(s))


class BatchRunner:
    """Runs batches of one pipeline on one SparkSession (driver side).

    ``spark`` is a SparkSession, or a function returning one that is called only when a
    batch executes: a dry run, a recovery or a replay never starts Spark."""

    def __init__(
        self, spark: Any | Callable[[], Any] | None, pipeline: Pipeline, settings: Settings
    ) -> None:
        self._spark = spark
        self.pipeline = pipeline
        self.settings = settings
        self.store: ObjectStore = open_store(pipeline.checkpoints, settings)
        self.layout = Layout()
        self.plans = PlanStore(self.store)
        self._broker: KafkaBrokerView | None = None
        check_storage_for_master(pipeline, settings.spark_master)
        _ship_user_code(pipeline)

    @property
    def spark(self) -> Any:
        """The session; made on first use when the runner was given a factory."""
        if self._spark is None:
            raise ConfigError(f"pipeline {self.name!r}: this runner has no SparkSession")
        if not hasattr(self._spark, "createDataFrame"):  # a factory, not a session
            self._spark = self._spark()
        return self._spark

    @property
    def name(self) -> str:
        return self.pipeline.name

    # Step 1 -------------------------------------------------------------------------
    def check_base(self, base: Manifest | None) -> None:
        if base is not None and base.pipeline_fingerprint != self.pipeline.fingerprint():
            raise CheckpointError(
                f"pipeline {self.name!r}: checkpoint {base.checkpoint_id} in {self.store.url} "
                f"was written by a different pipeline definition (fingerprint "
                f"{base.pipeline_fingerprint}, now {self.pipeline.fingerprint()}: the name "
                "or the process class changed). Use a new checkpoint location for a new "
                "pipeline."
            )
        if base is not None and base.max_parallelism != self.pipeline.max_parallelism:
            raise CheckpointError(
                f"pipeline {self.name!r}: checkpoint {base.checkpoint_id} has max_parallelism "
                f"{base.max_parallelism} but the pipeline now says "
                f"{self.pipeline.max_parallelism}. Run `microbatch reshard` to rewrite the "
                "state for the new value, or restore the old value."
            )

    def publish(self, manifest: Manifest, crash_at: str | None = None) -> None:
        """Step 5 (and 1): make a committed batch's output visible; idempotent."""
        batch_id = manifest.checkpoint_id
        staged_all = manifest.metadata.get("sinks", {})
        if "resharded_from" in manifest.metadata:  # a reshard has no output of its own
            self.store.put(f"published/{batch_id:020d}", b"")
            return
        if "replayed_from" in manifest.metadata:
            # A rewind: the Parquet output of the batches it undoes stays visible until the
            # batches that read their input again replace it (see sinks.parquet).
            first, last = manifest.metadata["replayed_from"]["undone"]
            for sink in self.pipeline.all_sinks():
                if not isinstance(sink, KafkaSink):
                    store = open_store(sink.url, self.settings)
                    parquet_sink.publish_rewind(store, batch_id, range(first, last + 1))
            self.store.put(f"published/{batch_id:020d}", b"")
            return
        for n, sink in enumerate(self.pipeline.all_sinks()):
            staged = [s for s in staged_all.get(sink.name, []) if s]
            if isinstance(sink, KafkaSink):
                messages = kafka_sink.load_messages(self.store, staged)
                kafka_sink.publish_messages(
                    self.settings.kafka_bootstrap_servers,
                    self.name,
                    sink.name,
                    sink.topic,
                    batch_id,
                    messages,
                    self.settings.kafka_client_config(),
                )
            else:
                store = open_store(sink.url, self.settings)
                ends = snapshot_from_json(manifest.metadata.get("offsets", {}))
                flat = {partition_name(*tp): n for tp, n in ends.items()}
                replaced = manifest.metadata.get("supersedes", ())
                parquet_sink.publish_parquet(store, batch_id, staged, flat, replaced)
            if n == 0:
                crash_if(crash_at, "during_publish", f"pipeline {self.name!r} batch {batch_id}")
        self.store.put(f"published/{batch_id:020d}", b"")
        try:
            mirror_offsets(
                self.settings.kafka_bootstrap_servers,
                consumer_group_name(self.name),
                snapshot_from_json(manifest.metadata.get("offsets", {})),
                client_config=self.settings.kafka_client_config(),
            )
        except MicrobatchError as e:  # the mirror is informational; the manifest is truth
            log.warning("pipeline %s: could not mirror offsets: %s", self.name, e)

    def is_published(self, batch_id: int) -> bool:
        return self.store.exists(f"published/{batch_id:020d}")

    # Step 2 -------------------------------------------------------------------------
    def plan(
        self, base: Manifest | None, options: BatchOptions
    ) -> tuple[BatchPlan, dict[str, Any], bool]:
        """(plan, spec, replayed): the stored plan of the next batch or a new one."""
        batch_id = 0 if base is None else base.checkpoint_id + 1
        existing = self.plans.load(batch_id)
        replayed = existing is not None
        if existing is None:
            src = self.pipeline.source
            limit = options.max_records_per_batch or src.max_records_per_batch
            plan = self.plans.plan_or_replay(
                self.broker(),
                pipeline=self.name,
                topics=src.topics,
                committed=_offsets(base),
                committed_batch_id=None if base is None else base.checkpoint_id,
                starting=_starting(self.pipeline),
                limits=BatchLimits(src.max_records_per_partition, limit),
                until_timestamp_ms=options.until_timestamp_ms,
                on_out_of_range=src.on_out_of_range,
            )
        else:
            plan = existing
        parallelism = check_parallelism_for(
            self.pipeline, options.parallelism or self.pipeline.parallelism
        )
        spec = {"batch_id": batch_id, "parallelism": parallelism, "run_id": options.run_id}
        try:
            self.store.create(spec_key(batch_id), json.dumps(spec).encode())
        except MicrobatchError:
            stored = json.loads(self.store.get(spec_key(batch_id)))
            if stored["parallelism"] != parallelism:
                log.warning(
                    "pipeline %s: batch %s replays its recorded plan at parallelism %s; "
                    "parallelism %s applies from the next batch",
                    self.name,
                    batch_id,
                    stored["parallelism"],
                    parallelism,
                )
            spec = stored
        return plan, spec, replayed

    def lag(self, offsets: dict[TopicPartition, int]) -> dict[str, int]:
        end = self.broker().end_offsets(list(offsets))
        return {str(tp): n for tp, n in partition_lag(end, offsets).items()}

    def broker(self) -> KafkaBrokerView:
        """One connection to the source's brokers per run (planning, then the lag after
        the commit): each new one costs a bootstrap and a metadata round trip."""
        if self._broker is None:
            self._broker = KafkaBrokerView.for_settings(self.settings)
        return self._broker

    def close_broker(self) -> None:
        if self._broker is not None:
            self._broker.close()
            self._broker = None

    # Step 3 -------------------------------------------------------------------------
    def stage_one(
        self,
        plan: BatchPlan,
        parallelism: int,
        watermark: int | None,
        crash_at: str | None,
        pending: pa.Table | None,
    ) -> Any:
        """The envelope rows of stage 1 (a DataFrame, not yet computed: stage 2's job runs
        it), for a batch with input (:func:`_has_input`).

        The planned ranges are read by the reader :meth:`read_planned` picks, recorded in
        :attr:`stage_one_reader`; both give the same Kafka rows to the same processing."""
        from pyspark.sql.pandas.types import from_arrow_schema

        envelope_type = from_arrow_schema(ENVELOPE_SCHEMA)
        process = StageOne(self.pipeline, parallelism, watermark, crash_at)
        envelopes = self.read_planned(plan, process, envelope_type)
        if pending is not None and pending.num_rows:
            rows = self.spark.createDataFrame(pending.to_pandas())
            reissue = dataclasses.replace(process, reissued=True)
            envelopes = envelopes.unionByName(rows.mapInArrow(reissue, envelope_type))
        return envelopes

    #: The reader of the last :meth:`stage_one`: "spark" (the JVM Kafka source), "python"
    #: (kafka-python) or None (nothing to read).
    stage_one_reader: str | None = None

    def read_planned(self, plan: BatchPlan, process: StageOne, envelope_type: Any) -> Any:
        """``process`` over the records of the planned ranges, read by the pipeline's
        ``KafkaSource.reader`` choice: Spark's Kafka source in the JVM, then ``process`` in
        a ``mapInArrow`` over its rows; or kafka-python inside the ``mapInArrow`` tasks
        themselves, one range per task (``range_descriptors``)."""
        bootstrap = self.settings.kafka_bootstrap_servers
        requested = self.pipeline.source.reader
        descriptors = None
        if plan.ranges:
            problem = None if requested == "python" else connector_problem(self.spark)
            self.stage_one_reader = choose_reader(self.name, requested, problem)
            log.info(
                "pipeline %s batch %s: stage 1 reads %d ranges with %s",
                self.name,
                plan.batch_id,
                len(plan.ranges),
                "Spark's Kafka source" if self.stage_one_reader == "spark" else "kafka-python",
            )
            if self.stage_one_reader == "spark":
                rows = read_ranges_spark(
                    self.spark,
                    bootstrap,
                    plan.ranges,
                    consumer_config=self.settings.kafka_client_config(),
                    view=self.broker(),
                )
                # Only the columns stage 1 reads cross from the JVM to Python.
                return rows.select(*SOURCE_COLUMNS).mapInArrow(process, envelope_type)
            descriptors = range_descriptors(self.spark, plan.ranges)
        if descriptors is None:
            return self.spark.createDataFrame([], envelope_type)
        reading = ReadingStageOne(process, bootstrap, self.settings.kafka_client_config())
        return descriptors.mapInArrow(reading, envelope_type)

    def load_pending(self, base: Manifest | None) -> pa.Table | None:
        """Enrichment inputs the last batch left unfinished, as stage-1 input rows (the
        :data:`SOURCE_COLUMNS`; ``value`` holds each pending element's bytes)."""
        ref = (base.metadata if base else {}).get("enrich_pending")
        if not ref:
            return None
        data = ipc.open_file(io.BytesIO(self.store.get(ref["file"]))).read_all()
        return pa.table(
            {
                "topic": data.column("topic"),
                "partition": data.column("partition"),
                "offset": data.column("offset"),
                "key": pa.nulls(data.num_rows, pa.binary()),
                "value": data.column("payload"),
            }
        )

    def save_pending(self, results: list[dict], batch_id: int) -> dict[str, Any] | None:
        """The pending enrichment inputs the instances handed back, in source order, as one
        Arrow file of the checkpoint (``load_pending`` reads it next batch)."""
        rows = sorted(tuple(p) for r in results for p in r["pending"])
        if not rows:
            return None
        topics, parts, offsets, payloads = zip(*rows, strict=True)
        table = pa.table(
            {
                "topic": pa.array(topics, pa.string()),
                "partition": pa.array(parts, pa.int32()),
                "offset": pa.array(offsets, pa.int64()),
                "payload": pa.array([base64.b64decode(p) for p in payloads], pa.binary()),
            }
        )
        buf = io.BytesIO()
        with ipc.new_file(buf, table.schema) as writer:
            writer.write_table(table)
        key = f"pending/{batch_id:020d}.arrow"
        self.store.put(key, buf.getvalue())
        return {"file": key, "count": table.num_rows}

    def stage_two(self, envelopes: Any, stage: StageTwo, parallelism: int) -> list[dict]:
        """Every operator instance processes its records (``envelopes``, stage 1's rows;
        None when stage 1 had no input) and fires its due timers, one group per instance;
        the one Spark job of the batch."""

        def per_instance(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
            received = list(batches)
            table = pa.Table.from_batches(received) if received else None
            instances = [] if table is None else pc.unique(table.column("instance")).to_pylist()
            if len(instances) != 1 or table is None:  # every partition holds its tick
                raise BatchError(
                    f"pipeline {stage.pipeline.name!r} batch {stage.batch_id}: a stage-2 "
                    f"partition holds instances {sorted(instances)}, expected exactly one"
                )
            yield from stage((instances[0],), table).to_batches()

        if envelopes is None:
            out = self._ticks_only(stage, parallelism)
        else:
            ticks = self.spark.createDataFrame(_ticks(range(parallelism)).to_pandas())
            rows = envelopes.unionByName(ticks)
            # Partition i holds instance i (a hash could put two in one task), and all of
            # it: mapInArrow over it is the group, without the sort a groupBy adds.
            out = (
                rows.repartitionById(parallelism, "instance")
                .mapInArrow(per_instance, RESULT_DDL)
                .collect()
            )
        results = [json.loads(r["result"]) for r in out]
        got = sorted(r["instance"] for r in results)
        if got != list(range(parallelism)):
            raise BatchError(
                f"pipeline {self.name!r} batch {stage.batch_id}: instances {got} reported, "
                f"expected 0..{parallelism - 1}"
            )
        return sorted(results, key=lambda r: r["instance"])

    def _ticks_only(self, stage: StageTwo, parallelism: int) -> list[Any]:
        """Stage 2 of a batch without input: each instance gets only its tick, so one task
        per instance (``spark.range`` with one row per slice) and no shuffle — a single
        short Spark stage instead of a shuffle map and reduce."""

        def per_task(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
            for batch in batches:
                for instance in batch.column("id").to_pylist():
                    yield from stage((instance,), _ticks([instance])).to_batches()

        slices = self.spark.range(0, parallelism, 1, parallelism)
        return slices.mapInArrow(per_task, RESULT_DDL).collect()

    # The protocol ---------------------------------------------------------------------
    def run(self, options: BatchOptions = BatchOptions()) -> BatchResult:
        crash_at = check_crash_point(options.crash_at)
        owner = options.run_id or f"cli-{uuid.uuid4().hex[:12]}"
        try:
            with fence.lease(self.store, self.name, owner, self.pipeline.lease_timeout_s):
                return self._run(options, crash_at)
        finally:
            self.close_broker()

    def _run(self, options: BatchOptions, crash_at: str | None) -> BatchResult:
        t0 = time.perf_counter()
        seconds: dict[str, float] = {}

        def lap(name: str, since: float) -> float:
            now = time.perf_counter()
            seconds[name] = round(now - since, 3)
            return now

        # Step 1: recover an unpublished commit.
        base = latest_manifest(self.store, self.layout)
        self.check_base(base)
        recovered = None
        if base is not None and not self.is_published(base.checkpoint_id):
            log.info("pipeline %s: publishing committed batch %s", self.name, base.checkpoint_id)
            self.publish(base)
            recovered = base.checkpoint_id
        t = lap("recover", t0)

        # Step 1b: a backfill past the pipeline's position rewinds to the interval's start.
        rewind = None
        if options.backfill and options.interval_start_ms is not None:
            target = find_rewind_target(
                self.name, base, options.interval_start_ms, self._load_if_retained
            )
            if target is not None:
                assert base is not None  # a target exists only behind a checkpoint
                rewind = {"to_checkpoint": target.checkpoint_id,
                          "undone": [target.undone_from, base.checkpoint_id]}  # fmt: skip
                if not options.dry_run:
                    base = self.rewind(base, target, options.accept_kafka_repeats)
                    rewind["checkpoint"] = base.checkpoint_id
            t = lap("rewind", t)

        # Step 2: plan (or replay the stored plan).
        plan, spec, replayed = self.plan(base, options)
        batch_id, parallelism = plan.batch_id, spec["parallelism"]
        where = f"pipeline {self.name!r} batch {batch_id}"
        result = BatchResult(self.name, batch_id, parallelism, "dry_run", replayed)
        result.recovered_publish = recovered
        result.rewind = rewind
        result.ranges = [
            {"topic": r.topic, "partition": r.partition, "from": r.start, "until": r.end}
            for r in plan.ranges
        ]
        t = lap("plan", t)
        crash_if(crash_at, "after_plan", where)
        if options.dry_run:
            result.lag = self.lag(plan.start_offsets)
            result.seconds = seconds
            return result

        # Step 3: execute. Spark starts here if it has not yet (a dry run never starts it).
        _ = self.spark
        t = lap("spark", t)
        wm_before = WatermarkState.from_json((base.metadata if base else {}).get("event_time"))
        pending_in = self.load_pending(base)
        has_input = _has_input(plan, pending_in)
        full = should_write_full(base, batch_id, self.pipeline.full_checkpoint_every)
        stage = StageTwo(
            pipeline=self.pipeline,
            settings=self.settings,
            batch_id=batch_id,
            parallelism=parallelism,
            base_manifest=None if base is None else base.to_json(),
            event_time=wm_before.to_json(),
            processing_time_ms=plan.created_at,
            full=full,
            crash_at=crash_at,
        )
        self.stage_one_reader = None  # until stage_one picks one: an empty batch reads nothing
        envelopes = (
            self.stage_one(plan, parallelism, wm_before.watermark, crash_at, pending_in)
            if has_input
            else None
        )
        results = self.stage_two(envelopes, stage, parallelism)
        t = lap("execute", t)
        stats, event_time = _agreed_stage_one(where, results)
        wm_state = WatermarkState.from_json(event_time)
        pending_out = self.save_pending(results, batch_id) if stats["pending"] else None
        crash_if(crash_at, "after_sink_staging", where)

        # Dead-letter threshold, before anything commits.
        records_in = stats["inputs"]
        dead = sum(r["stats"].get("dead_letters", 0) for r in results)
        reasons: dict[str, int] = {}
        for r in results:
            for k, v in r["stats"].items():
                if k.startswith("dead_letters."):
                    reasons[k.split(".", 1)[1]] = reasons.get(k.split(".", 1)[1], 0) + v
        dl = self.pipeline.dead_letters
        if dl is not None and dl.max_ratio is not None and records_in:
            ratio = dead / records_in
            if ratio > dl.max_ratio:
                raise BatchError(
                    f"{where}: {dead} of {records_in} records ({ratio:.1%}) went to the dead "
                    f"letters, above max_ratio {dl.max_ratio:.1%}; reasons: {reasons}. Nothing "
                    "was committed: fix the input or the pipeline, or raise max_ratio."
                )

        # Step 4: commit the manifest.
        snaps = [snap_in(r["snapshot"]) for r in results]
        sinks: dict[str, list[Any]] = {s.name: [] for s in self.pipeline.all_sinks()}
        for r in results:
            for name, staged in r["staged"].items():
                sinks[name].append(staged)
        outputs = {name: sum(s["rows"] for s in staged if s) for name, staged in sinks.items()}
        offsets = plan.end_offsets()
        supersedes, awaiting = parquet_sink.after_batch(
            self.awaiting_replacement(base),
            {partition_name(*tp): n for tp, n in offsets.items()},
        )
        metadata = {
            "batch": {
                "parallelism": parallelism,
                "processing_time_ms": plan.created_at,
                "until_timestamp_ms": plan.until_timestamp_ms,
                "interval_start_ms": options.interval_start_ms,
                "ends_exactly": plan.reaches_until is True,
                "base_checkpoint": None if base is None else base.checkpoint_id,
                **({} if base else {"from_offsets": snapshot_to_json(plan.start_offsets)}),
                "run_id": spec.get("run_id"),
                "replayed": replayed,
            },
            "offsets": snapshot_to_json(offsets),
            "event_time": wm_state.to_json(),
            "watermark": wm_state.watermark,
            "enrich_pending": pending_out,
            "sinks": sinks,
            "supersedes": supersedes,
            "awaiting_replacement": awaiting,
            "stats": {
                "records_in": records_in,
                "dead_letters": dead,
                "dead_letter_reasons": reasons,
                "outputs": outputs,
                "enrich_pending": stats["pending"],
                "enrich_reissued": 0 if pending_in is None else pending_in.num_rows,
                "per_partition": stats["per_partition"],
                "skipped": snapshot_to_json(plan.skipped),
                "reader": self.stage_one_reader,  # "spark", "python" or None (no input)
                # Driver-side phases up to the commit (publish and GC come after it).
                "seconds": {**seconds, "to_commit": round(time.perf_counter() - t0, 3)},
                "instances": [
                    {"instance": r["instance"], **r["stats"], "seconds": r["seconds"]}
                    for r in results
                ],
            },
        }
        manifest = build_manifest(
            batch_id,
            snaps,
            max_parallelism=self.pipeline.max_parallelism,
            pipeline_fingerprint=self.pipeline.fingerprint(),
            base=base,
            full=full,
            metadata=metadata,
        )
        try:
            commit_manifest(self.store, self.layout, manifest)
        except CheckpointError as e:
            raise BatchError(
                f"{where}: another run committed this batch first; this run's work is "
                f"discarded ({e})"
            ) from e
        t = lap("commit", t)
        crash_if(crash_at, "after_commit", where)

        # Step 5: publish.
        self.publish(manifest, crash_at)
        t = lap("publish", t)

        # Step 6: GC.
        self.gc()
        lap("gc", t)
        seconds["total"] = round(time.perf_counter() - t0, 3)

        result.status = "committed"
        result.records_in = records_in
        result.dead_letters = dead
        result.dead_letter_reasons = reasons
        result.outputs = {k: v for k, v in outputs.items() if k != DEAD_LETTER_SINK}
        result.watermark = wm_state.watermark
        result.state_bytes_written = sum(s.bytes_written for s in snaps)
        result.lag = self.lag(offsets)
        result.seconds = seconds
        log.info("%s committed: %s", where, json.dumps(result.to_json()))
        return result

    # Replay and rewind ----------------------------------------------------------------
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
        self.refuse_kafka_repeats(what, accept_kafka_repeats)
        owner = run_id or f"replay-{uuid.uuid4().hex[:12]}"
        with fence.lease(self.store, self.name, owner, self.pipeline.lease_timeout_s):
            latest = latest_manifest(self.store, self.layout)
            self.check_base(latest)
            if latest is not None and not self.is_published(latest.checkpoint_id):
                self.publish(latest)
            source = load_manifest(self.store, self.layout, checkpoint_id)
            if latest is None or checkpoint_id >= latest.checkpoint_id:
                raise ConfigError(
                    f"pipeline {self.name!r}: checkpoint {checkpoint_id} is the latest; "
                    "there is nothing to replay"
                )
            target = RewindTarget(source, source.metadata.get("offsets", {}), checkpoint_id + 1)
            return self.rewind(latest, target, accept_kafka_repeats)

    def rewind(
        self, latest: Manifest, target: RewindTarget, accept_kafka_repeats: bool
    ) -> Manifest:
        """Commit and publish a copy of ``target`` as the newest checkpoint (under the
        caller's lease); the batches after it read their records again."""
        what = "rewinding to " + (
            "before the first batch"
            if target.manifest is None
            else f"checkpoint {target.checkpoint_id}"
        )
        self.refuse_kafka_repeats(what, accept_kafka_repeats)
        where = f"pipeline {self.name!r}: {what}"
        if target.manifest is not None and target.manifest.max_parallelism != (
            self.pipeline.max_parallelism
        ):
            raise ConfigError(
                f"{where}: that checkpoint has max_parallelism "
                f"{target.manifest.max_parallelism}, the pipeline now "
                f"{self.pipeline.max_parallelism} (a reshard happened since). Processing "
                "cannot go back across a reshard."
            )
        self.check_source_retained(where, target)
        metadata: dict[str, Any]
        if target.manifest is None:
            metadata = {"offsets": dict(target.offsets), "batch": {
                "until_timestamp_ms": target.at_ms,
                "base_checkpoint": None}}  # fmt: skip
            source = Manifest(
                checkpoint_id=latest.checkpoint_id + 1,
                pipeline_fingerprint=self.pipeline.fingerprint(),
                max_parallelism=self.pipeline.max_parallelism,
                parallelism=self.pipeline.parallelism,
                key_groups=(None,) * self.pipeline.max_parallelism,
                full_checkpoint_id=latest.checkpoint_id + 1,
                created_at="",
            )
        else:
            source = target.manifest
            # The batch record stays: the copy stands for its source in the lineage.
            metadata = {k: v for k, v in source.metadata.items() if k not in ("sinks", "stats")}
        metadata["replayed_from"] = {
            "checkpoint_id": target.checkpoint_id,
            "undone": [target.undone_from, latest.checkpoint_id],
        }
        metadata.pop("supersedes", None)  # a rewind replaces nothing itself
        metadata["awaiting_replacement"] = self.scan_awaiting(
            range(target.undone_from, latest.checkpoint_id + 1)
        )
        manifest = dataclasses.replace(
            source,
            checkpoint_id=latest.checkpoint_id + 1,
            created_at=dt.datetime.now(dt.UTC).isoformat(timespec="milliseconds"),
            metadata=metadata,
        )
        commit_manifest(self.store, self.layout, manifest)
        self.publish(manifest)
        log.info("%s: committed checkpoint %s", where, manifest.checkpoint_id)
        return manifest

    def awaiting_replacement(self, base: Manifest | None) -> parquet_sink.Awaiting:
        """Undone batches whose Parquet output still awaits replacement, as ``base``
        recorded them."""
        if base is None:
            return {}
        if "awaiting_replacement" in base.metadata:
            return base.metadata["awaiting_replacement"]
        return self.scan_awaiting()  # a checkpoint written before the mapping existed

    def scan_awaiting(self, undone: range = range(0)) -> parquet_sink.Awaiting:
        """The same, read from the Parquet sinks' ``_commits`` entries (all of them: for
        rewinds only), counting ``undone`` as undone too."""
        out: parquet_sink.Awaiting = {}
        for sink in self.pipeline.all_sinks():
            if not isinstance(sink, KafkaSink):
                store = open_store(sink.url, self.settings)
                out.update(parquet_sink.awaiting_replacement(store, undone))
        return dict(sorted(out.items(), key=lambda item: int(item[0])))

    def refuse_kafka_repeats(self, what: str, accept_kafka_repeats: bool) -> None:
        kafka = [s.name for s in self.pipeline.all_sinks() if isinstance(s, KafkaSink)]
        if kafka and not accept_kafka_repeats:
            raise ConfigError(
                f"pipeline {self.name!r}: {what} will publish the outputs of the undone "
                f"batches again to Kafka sinks {kafka} (Kafka records cannot be retracted). "
                "Pass --accept-kafka-repeats (Airflow: kafka_repeats_on_backfill=True) if "
                "consumers of those topics deduplicate (e.g. by key)."
            )

    def check_source_retained(self, where: str, target: RewindTarget) -> None:
        """Refuse a rewind whose records Kafka no longer has (retention or compaction
        deleted them): the reprocessed intervals would silently miss them."""
        offsets = snapshot_from_json(target.offsets)
        if not offsets:
            return
        with KafkaBrokerView.for_settings(self.settings) as view:
            earliest = view.beginning_offsets(list(offsets))
        gone = {tp: (n, earliest[tp]) for tp, n in offsets.items() if earliest.get(tp, 0) > n}
        if gone:
            listed = ", ".join(
                f"{tp.topic}[{tp.partition}] needs offset {n}, earliest kept is {first}"
                for tp, (n, first) in sorted(gone.items())
            )
            raise ConfigError(
                f"{where}: Kafka no longer has the records to reprocess ({listed}); the "
                "topic's retention deleted them. Backfill only intervals whose records are "
                "still in Kafka."
            )

    def _load_if_retained(self, checkpoint_id: int) -> Manifest | None:
        if checkpoint_id < 0:
            return None
        try:
            return load_manifest(self.store, self.layout, checkpoint_id)
        except CheckpointError:
            return None

    # Step 6 -------------------------------------------------------------------------
    def gc(self) -> None:
        kept = collect_garbage(self.store, self.layout, self.pipeline.retain_checkpoints)
        if not kept.retained:
            return
        oldest, newest = kept.retained[0], kept.retained[-1]
        for prefix, keep in (
            (SPEC_PREFIX, lambda b: b >= oldest),
            ("plans/", lambda b: b >= oldest),
            ("pending/", lambda b: b >= oldest),
            ("published/", lambda b: b >= oldest),
            ("staging/", lambda b: b > newest),  # published staging is no longer needed
        ):
            for key in self.store.list(prefix):
                batch = _batch_of(key[len(prefix) :])
                if batch is not None and not keep(batch) and self.is_safe_to_drop(key, newest):
                    self.store.delete(key)

    def is_safe_to_drop(self, key: str, newest: int) -> bool:
        # Staging of the newest batch is dropped only once it is published.
        return not key.startswith(f"staging/{newest:020d}/") or self.is_published(newest)


def check_storage_for_master(pipeline: Pipeline, master: str) -> None:
    """Executors of a real cluster share no filesystem: state and Parquet output must then
    live on S3, or one executor would restore state another never sees."""
    if master.startswith("local"):
        return
    urls = {"checkpoints": pipeline.checkpoints}
    for sink in pipeline.all_sinks():
        if not isinstance(sink, KafkaSink):
            urls[f"sink {sink.name!r}"] = sink.url
    local = {what: url for what, url in urls.items() if not url.startswith("s3://")}
    if local:
        listed = ", ".join(f"{what} = {url!r}" for what, url in local.items())
        raise ConfigError(
            f"pipeline {pipeline.name!r} runs on Spark master {master!r}, whose executors do "
            f"not share a filesystem, but {listed} is on the local filesystem. Put checkpoints "
            "and Parquet sinks on S3 (s3://bucket/prefix), or use a local[*] master."
        )


def _batch_of(name: str) -> int | None:
    head = name.split("/", 1)[0].split(".", 1)[0]
    return int(head) if head.isdigit() else None


def _ticks(instances: Sequence[int]) -> pa.Table:
    """One tick envelope per instance: what makes an instance run, and fire its due
    timers, when it has no records."""
    cols: dict[str, list[Any]] = {f.name: [None] * len(instances) for f in ENVELOPE_SCHEMA}
    cols["kind"] = [TICK] * len(instances)
    cols["instance"] = list(instances)
    return pa.Table.from_pydict(cols, schema=ENVELOPE_SCHEMA)


def _has_input(plan: BatchPlan, pending: pa.Table | None) -> bool:
    """Does stage 1 have anything to read? (``plan.ranges`` holds only non-empty ranges.)"""
    return bool(plan.ranges) or (pending is not None and pending.num_rows > 0)


def _agreed_stage_one(where: str, results: list[dict]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Stage 1's totals and the batch's event-time state, which every instance computed
    from the same ``stat`` rows. They differ only if Spark re-ran a stage-1 task whose
    output was not the same (enrichment deadlines) after some instances had read it: then
    this attempt commits nothing."""
    totals = [(r["stage_one"], r["event_time"]) for r in results]
    if any(t != totals[0] for t in totals[1:]):
        raise BatchError(
            f"{where}: the operator instances saw different stage-1 results (a stage-1 "
            "task ran twice with different output); nothing was committed, run the batch "
            "again"
        )
    return totals[0]


def _ship_user_code(pipeline: Pipeline) -> None:
    """Pickle the pipeline's own modules by value, so Spark workers need not import them
    (a job file run by spark-submit, a test module): only the library must be installed.

    Library, standard-library and installed modules are left alone (pickled by name)."""
    import functools
    import sys
    import types

    from pyspark import cloudpickle

    objs: list[Any] = [pipeline.process, pipeline.source.decoder, pipeline.key_by]
    if pipeline.enrich is not None:
        objs.append(pipeline.enrich.make_operator)
    installed = tuple({sys.prefix, sys.base_prefix, sys.exec_prefix})
    for obj in objs:
        while isinstance(obj, functools.partial):
            obj = obj.func
        if obj is None or isinstance(obj, str):
            continue
        is_code = isinstance(obj, types.FunctionType | type)
        mod_name = obj.__module__ if is_code else type(obj).__module__
        module = sys.modules.get(mod_name)
        path = getattr(module, "__file__", None) or ""
        if (
            module is None
            or mod_name == "__main__"
            or mod_name.split(".")[0] == "microbatch"
            or not path
            or path.startswith(installed)
        ):
            continue
        cloudpickle.register_pickle_by_value(module)


def run_batch(
    spark: Any, pipeline: Pipeline, settings: Settings, options: BatchOptions = BatchOptions()
) -> BatchResult:
    """Run the next batch of ``pipeline`` (see the module docstring)."""
    return BatchRunner(spark, pipeline, settings).run(options)


def load_spec(store: ObjectStore, batch_id: int) -> dict[str, Any] | None:
    try:
        return json.loads(store.get(spec_key(batch_id)))
    except ObjectNotFoundError:
        return None
