"""Step 3 of the protocol on Spark: one job runs stage 1 and stage 2 of a batch.

Stage 1 (``mapInArrow``) reads the planned ranges — Spark's JVM Kafka source or
kafka-python inside the tasks — decodes, enriches, keys and routes (:mod:`.stage_one`);
``repartitionById`` puts each operator instance's rows in one partition; stage 2
(``mapInArrow`` over it, :mod:`.stage_two`) restores, processes, writes state and stages
sink output. Nothing is materialised between the stages: the shuffle is the only copy.
A batch without input runs only stage 2, one task per instance and no shuffle.

The protocol talks to an :class:`Executor`; :class:`SparkExecutor` is the one that runs
batches, and a stand-in lets the protocol be tested without Spark.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, Protocol, cast

import pyarrow as pa
import pyarrow.compute as pc

from microbatch.errors import BatchError, ConfigError
from microbatch.gcpause import freeze_in_spark_worker
from microbatch.kafka import BatchPlan, BrokerView
from microbatch.kafka.confluent_reader import confluent_problem
from microbatch.kafka.native_reader import native_problem
from microbatch.kafka.reader import range_descriptors
from microbatch.kafka.spark_source import choose_reader, connector_problem, read_ranges_spark
from microbatch.runtime.envelope import SOURCE_COLUMNS, ticks
from microbatch.runtime.one_stage import one_stage_frame, runs_in_one_stage, with_batch_totals
from microbatch.runtime.packed import Packing, unpacked
from microbatch.runtime.pipeline import Pipeline
from microbatch.runtime.records import InstanceResult
from microbatch.runtime.spine import spine_frame, step_results
from microbatch.runtime.stage_one import ReadingStageOne, StageOne
from microbatch.runtime.stage_two import RESULT_DDL, StageTwo
from microbatch.runtime.windowed import exchange_schema
from microbatch.runtime.wire import tags_of
from microbatch.settings import Settings

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

log = logging.getLogger(__name__)
_READER_NAMES = {
    "spark": "Spark's Kafka source",
    "confluent": "confluent-kafka",
    "native": "the native reader",
}


@dataclasses.dataclass(frozen=True)
class Execution:
    """What one execution of a batch produced: every instance's result, in instance
    order, and the stage-1 reader used ("spark", "python", "confluent", "native", or None: nothing
    to read)."""

    results: tuple[InstanceResult, ...]
    reader: str | None
    #: A dataflow's further keyed steps: their instances' results, by uid (the first
    #: step's are ``results``, with every step's staged output and counters merged in).
    steps: Mapping[str, tuple[InstanceResult, ...]] = dataclasses.field(default_factory=dict)


class Executor(Protocol):
    def prepare(self) -> None:
        """Get ready to execute (start Spark): timed on its own, before execution."""
        ...

    def execute(
        self, plan: BatchPlan, stage: StageTwo, pending: pa.Table | None, watermark: int | None
    ) -> Execution:
        """Run the batch ``plan`` with stage 2 ``stage``; ``pending``: enrichment inputs
        of the last checkpoint, re-issued first; ``watermark``: the one the batch starts
        with (records behind it are late)."""
        ...


class SparkExecutor:
    """Runs batches of one pipeline on one SparkSession (driver side).

    ``spark`` is a SparkSession, or a function returning one, called only when a batch
    executes: a dry run, a recovery or a replay never starts Spark."""

    def __init__(
        self,
        spark: Any | Callable[[], Any] | None,
        pipeline: Pipeline,
        settings: Settings,
        broker: Callable[[], BrokerView],
    ) -> None:
        self._spark = spark
        self.pipeline = pipeline
        self.settings = settings
        self.broker = broker
        #: The DataFrame of the last batch that read input or ran a dataflow (for its
        #: plan: ``explain()``).
        self.last_frame: Any = None
        ship_user_code(pipeline)

    @property
    def spark(self) -> Any:
        """The session; made on first use when the executor was given a factory."""
        if self._spark is None:
            raise ConfigError(f"pipeline {self.pipeline.name!r}: this runner has no SparkSession")
        if not hasattr(self._spark, "createDataFrame"):  # a factory, not a session
            self._spark = self._spark()
        return self._spark

    def prepare(self) -> None:
        _ = self.spark

    def execute(
        self, plan: BatchPlan, stage: StageTwo, pending: pa.Table | None, watermark: int | None
    ) -> Execution:
        if self.pipeline.steps:
            return self.execute_dataflow(plan, stage, pending, watermark)
        if not has_input(plan, pending):
            return Execution(self._collect(self._ticks_only(stage), stage), None)
        process = StageOne(self.pipeline, stage.parallelism, watermark, stage.crash_at)
        reader = self.choose_reader(plan)
        reissued = 0 if pending is None else pending.num_rows
        if reader is not None and runs_in_one_stage(self.pipeline, reader, reissued):
            reading = self.reading(process, reader)
            frame = one_stage_frame(self.spark, plan.ranges, reading, stage)
            self.last_frame = frame
            results = self._collect(frame.collect(), stage)
            return Execution(with_batch_totals(results, stage), reader)
        envelopes = self.stage_one(plan, process, pending, reader)
        tick_rows = self._tick_rows(stage)
        ticked = envelopes.unionByName(tick_rows)
        # Partition i holds instance i (a hash could put two in one task), and all of it:
        # mapInArrow over it is the group, without the sort a groupBy adds.
        frame = ticked.repartitionById(stage.parallelism, "instance").mapInArrow(
            _per_instance(stage), RESULT_DDL
        )
        self.last_frame = frame
        return Execution(self._collect(frame.collect(), stage), reader)

    def execute_dataflow(
        self, plan: BatchPlan, stage: StageTwo, pending: pa.Table | None, watermark: int | None
    ) -> Execution:
        """Stage 1, then every keyed step with its exchange, in one job (:mod:`.spine`);
        also without input, since timers of one step may feed the next."""
        rows = self._tick_rows(stage)
        reader = None
        if has_input(plan, pending):
            process = StageOne(self.pipeline, stage.parallelism, watermark, stage.crash_at)
            reader = self.choose_reader(plan)
            envelopes = self.stage_one(plan, process, pending, reader)
            rows = envelopes.unionByName(rows)
        frame = spine_frame(rows, stage)
        self.last_frame = frame  # what ran: its plan shows one exchange per keyed step
        first, steps = step_results(frame.collect(), stage)
        return Execution(merged_results(first, steps), reader, steps)

    def stage_one(
        self, plan: BatchPlan, process: StageOne, pending: pa.Table | None, reader: str | None
    ) -> Any:
        """The envelope rows of stage 1 (a DataFrame, not yet computed: stage 2's job runs
        it), its planned ranges read by ``reader`` (:meth:`choose_reader`)."""
        from pyspark.sql.pandas.types import from_arrow_schema

        tags = tags_of(self.pipeline)
        envelope_type = from_arrow_schema(tags.wire_schema(exchange_schema(self.pipeline)))
        envelopes = self.read_planned(plan, process, envelope_type, reader)
        if pending is not None and pending.num_rows:
            rows = self.spark.createDataFrame(pending.to_pandas())
            reissue = dataclasses.replace(process, reissued=True)
            envelopes = envelopes.unionByName(
                rows.mapInArrow(Packing(reissue, self.pipeline), envelope_type)
            )
        return envelopes

    def read_planned(
        self, plan: BatchPlan, process: StageOne, envelope_type: Any, reader: str | None
    ) -> Any:
        """``process`` over the records of the planned ranges, read by the pipeline's
        ``KafkaSource.reader`` choice: Spark's Kafka source in the JVM, then ``process`` in
        a ``mapInArrow`` over its rows; or the native reader, confluent-kafka or
        kafka-python inside the ``mapInArrow`` tasks themselves, one range per task
        (``range_descriptors``)."""
        if reader is None:
            return self.spark.createDataFrame([], envelope_type)
        source = self.pipeline.source
        if reader == "spark":
            rows = read_ranges_spark(
                self.spark,
                self.settings.kafka_bootstrap_servers,
                plan.ranges,
                consumer_config=self.settings.kafka_client_config(source.consumer_config),
                view=self.broker(),
            )
            # Only the columns stage 1 reads cross from the JVM to Python.
            return rows.select(*SOURCE_COLUMNS).mapInArrow(
                Packing(process, self.pipeline), envelope_type
            )
        # None only without a non-empty range: plan.ranges holds only non-empty ones.
        descriptors = cast("DataFrame", range_descriptors(self.spark, plan.ranges))
        reading = Packing(self.reading(process, reader), self.pipeline)
        return descriptors.mapInArrow(reading, envelope_type)

    def choose_reader(self, plan: BatchPlan) -> str | None:
        """The reader of the planned ranges (None: there are none): the pipeline's
        ``KafkaSource.reader``, with ``"auto"`` decided by what this machine and session
        can do."""
        if not plan.ranges:
            return None
        source = self.pipeline.source
        requested = source.reader
        config = self.settings.kafka_client_config(source.consumer_config)
        auto = requested == "auto"
        native = native_problem(config) if auto else "unused"
        librdkafka = confluent_problem(config) if auto and native is not None else "unused"
        chosen_before = (
            requested in ("python", "confluent", "native") or native is None or librdkafka is None
        )
        problem = None if chosen_before else connector_problem(self.spark)
        reader = choose_reader(self.pipeline.name, requested, problem, librdkafka, native)
        log.info(
            "pipeline %s batch %s: stage 1 reads %d ranges with %s",
            self.pipeline.name,
            plan.batch_id,
            len(plan.ranges),
            _READER_NAMES.get(reader, "kafka-python"),
        )
        return reader

    def reading(self, process: StageOne, reader: str) -> ReadingStageOne:
        """Stage 1 reading its ranges in its own tasks with ``reader``."""
        config = self.settings.kafka_client_config(self.pipeline.source.consumer_config)
        return ReadingStageOne(
            process, self.settings.kafka_bootstrap_servers, config, client=reader
        )

    def _tick_rows(self, stage: StageTwo) -> Any:
        """A ``tick`` row per instance, as stage 1's rows cross the exchange: so every
        instance runs (and fires its timers) without input."""
        from pyspark.sql.pandas.types import from_arrow_schema

        tags, schema = tags_of(self.pipeline), exchange_schema(self.pipeline)
        rows = tags.to_wire(ticks(range(stage.parallelism), schema))
        # The exchange schema, not the one pandas infers: all-null integer columns would
        # come out as doubles and widen the union's (a dead letter's offset "794.0").
        return self.spark.createDataFrame(rows.to_pandas(), schema=from_arrow_schema(rows.schema))

    def _ticks_only(self, stage: StageTwo) -> list[Any]:
        """Stage 2 of a batch without input: each instance gets only its tick, so one task
        per instance (``spark.range`` with one row per slice) and no shuffle — a single
        short Spark stage instead of a shuffle map and reduce."""

        schema = exchange_schema(self.pipeline)

        def per_task(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
            freeze_in_spark_worker()
            for batch in batches:
                for instance in batch.column("id").to_pylist():
                    yield from stage((instance,), ticks([instance], schema)).to_batches()

        slices = self.spark.range(0, stage.parallelism, 1, stage.parallelism)
        return cast("list[Any]", slices.mapInArrow(per_task, RESULT_DDL).collect())

    def _collect(self, rows: list[Any], stage: StageTwo) -> tuple[InstanceResult, ...]:
        results = sorted(
            (InstanceResult.from_json(json.loads(r["result"])) for r in rows),
            key=lambda r: r.instance,
        )
        got = [r.instance for r in results]
        if got != list(range(stage.parallelism)):
            raise BatchError(
                f"pipeline {self.pipeline.name!r} batch {stage.batch_id}: instances {got} "
                f"reported, expected 0..{stage.parallelism - 1}"
            )
        return tuple(results)


def _per_instance(
    stage: StageTwo,
) -> Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]]:
    """The mapInArrow body over one ``repartitionById`` partition: one whole instance."""

    def per_instance(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        freeze_in_spark_worker()
        received = list(batches)
        table = pa.Table.from_batches(received) if received else None  # the stage decodes it
        if table is not None:
            where = f"pipeline {stage.pipeline.name!r} batch {stage.batch_id}"
            table = unpacked(table, tags_of(stage.pipeline), where)
        instances = [] if table is None else pc.unique(table.column("instance")).to_pylist()
        if len(instances) != 1 or table is None:  # every partition holds its tick
            raise BatchError(
                f"pipeline {stage.pipeline.name!r} batch {stage.batch_id}: a stage-2 "
                f"partition holds instances {sorted(instances)}, expected exactly one"
            )
        yield from stage((instances[0],), table).to_batches()

    return per_instance


def merged_results(
    first: tuple[InstanceResult, ...], steps: Mapping[str, tuple[InstanceResult, ...]]
) -> tuple[InstanceResult, ...]:
    """The first step's results with every further step's staged output and counters
    merged in, per instance: what the batch record and stats are made of. A further
    step's counters and seconds are named ``<uid>.<name>``; the dead letters count once,
    as the last step (which staged them all) counted them."""
    if not steps:
        return first
    last = list(steps.values())[-1]
    merged = []
    for i, result in enumerate(first):
        staged = dict(result.staged)
        counters = {k: v for k, v in result.counters.items() if not k.startswith("dead_letters")}
        seconds = dict(result.seconds)
        for uid, results in steps.items():
            staged |= results[i].staged
            for k, v in results[i].counters.items():
                if not k.startswith("dead_letters"):
                    counters[f"{uid}.{k}"] = v
            seconds |= {f"{uid}.{k}": v for k, v in results[i].seconds.items()}
        counters |= {k: v for k, v in last[i].counters.items() if k.startswith("dead_letters")}
        merged.append(
            dataclasses.replace(result, staged=staged, counters=counters, seconds=seconds)
        )
    return tuple(merged)


def check_storage_for_master(pipeline: Pipeline, master: str) -> None:
    """Executors of a real cluster share no filesystem: state and sink files must then
    live on S3, or one executor would restore state another never sees."""
    if master.startswith("local"):
        return
    urls = {"checkpoints": pipeline.checkpoints}
    for sink in pipeline.all_sinks():
        url = sink.shared_storage_url()
        if url is not None:
            urls[f"sink {sink.name!r}"] = url
    local = {what: url for what, url in urls.items() if not url.startswith("s3://")}
    if local:
        listed = ", ".join(f"{what} = {url!r}" for what, url in local.items())
        raise ConfigError(
            f"pipeline {pipeline.name!r} runs on Spark master {master!r}, whose executors do "
            f"not share a filesystem, but {listed} is on the local filesystem. Put checkpoints "
            "and Parquet sinks on S3 (s3://bucket/prefix), or use a local[*] master."
        )


def has_input(plan: BatchPlan, pending: pa.Table | None) -> bool:
    """Does stage 1 have anything to read? (``plan.ranges`` holds only non-empty ranges.)"""
    return bool(plan.ranges) or (pending is not None and pending.num_rows > 0)


def ship_user_code(pipeline: Pipeline) -> None:
    """Pickle the pipeline's own modules by value, so Spark workers need not import them
    (a job file run by spark-submit, a test module): only the library must be installed.

    Library, standard-library and installed modules are left alone (pickled by name)."""
    import functools
    import sys
    import types

    from pyspark import cloudpickle

    objs: list[Any] = [pipeline.process, pipeline.source.decoder, pipeline.key_by]
    objs += [s.fn for s in pipeline.prefix]
    for i in pipeline.inputs:
        objs += [i.source.decoder, *(s.fn for s in i.prefix)]
    for step in pipeline.steps:
        objs += [step.process, step.key_by, *(s.fn for s in step.before)]
        objs += [s.fn for tap in step.taps for s in tap.chain]
    objs += [s.fn for tap in pipeline.taps or () for s in tap.chain]
    objs += [s.fn for tap in pipeline.source_taps for s in tap.chain]
    for edge in pipeline.edges:
        objs += [edge.key_by, *(s.fn for s in edge.chain)]
    objs += [type(s) for s in pipeline.all_sinks()]  # a user's own sink class
    if pipeline.enrich is not None:
        objs.append(pipeline.enrich.make_operator)
    objs += held_by_library_objects(objs)
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


def held_by_library_objects(objs: list[Any], depth: int = 2) -> list[Any]:
    """The user's functions that library objects hold (a join's ``select``, its time
    functions, a custom aggregate's functions), ``depth`` attributes down: they are
    pickled with the object, so their modules must ship too."""
    found: list[Any] = []
    level = [o for o in objs if type(o).__module__.split(".")[0] == "microbatch"]
    for _ in range(depth):
        nested: list[Any] = []
        for obj in level:
            for value in getattr(obj, "__dict__", {}).values():
                if callable(value) or hasattr(value, "__dict__"):
                    found.append(value)
                    if type(value).__module__.split(".")[0] == "microbatch":
                        nested.append(value)
        level = nested
    return found
