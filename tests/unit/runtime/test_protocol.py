"""The commit protocol without Spark or Kafka: a stand-in broker plans, a stand-in executor
runs the real stage-1 and stage-2 functions in this process, checkpoints and the Parquet
sink live on the local filesystem. Crash points, phases and recovery are pinned here; the
same runs on Spark and Kafka are in tests/integration/runtime."""

from __future__ import annotations

import dataclasses
import json
from collections import defaultdict
from collections.abc import Collection
from pathlib import Path

import pyarrow as pa
import pytest

from microbatch.checkpoint import Layout, latest_manifest, load_manifest
from microbatch.errors import BatchError, CheckpointError, ConfigError, SourceError
from microbatch.kafka import BatchPlan, BrokerView, TopicPartition
from microbatch.runtime import (
    BatchOptions,
    BatchRunner,
    InjectedCrash,
    KafkaSource,
    KeyedProcessFunction,
    ParquetSink,
    Pipeline,
)
from microbatch.runtime.envelope import SOURCE_COLUMNS, ticks
from microbatch.runtime.execute import Execution, has_input
from microbatch.runtime.phases import Phase, phase_of
from microbatch.runtime.records import BatchRecord, InstanceResult
from microbatch.runtime.schema import JsonSchema
from microbatch.runtime.stage_one import StageOne
from microbatch.runtime.stage_two import StageTwo
from microbatch.runtime.windowed import exchange_schema
from microbatch.runtime.wire import tags_of
from microbatch.settings import Settings
from microbatch.sinks import parquet as ps
from microbatch.sinks import read_parquet_sink
from microbatch.storage import open_store


class CountPerUser(KeyedProcessFunction):
    def process(self, key, records, ctx) -> None:
        total = ctx.value("total")
        total.set(total.get(0) + len(records))
        ctx.emit({"user": key, "total": total.get()})


class Log:
    """A stand-in for the source's brokers: one topic's partitions as lists of values."""

    bootstrap_servers = "stand-in:9092"

    def __init__(self, partitions: int) -> None:
        self.values: dict[TopicPartition, list[bytes]] = {
            TopicPartition("clicks", p): [] for p in range(partitions)
        }
        self.start: dict[TopicPartition, int] = dict.fromkeys(self.values, 0)  # retention

    def produce(self, partition: int, *users: str) -> None:
        log = self.values[TopicPartition("clicks", partition)]
        log.extend(json.dumps({"user": u, "n": len(log) + i}).encode() for i, u in enumerate(users))

    def partitions_for(self, topic: str) -> set[int] | None:
        return {tp.partition for tp in self.values if tp.topic == topic} or None

    def beginning_offsets(self, tps: Collection[TopicPartition]) -> dict[TopicPartition, int]:
        return {tp: self.start[tp] for tp in tps}

    def end_offsets(self, tps: Collection[TopicPartition]) -> dict[TopicPartition, int]:
        return {tp: len(self.values[tp]) for tp in tps}

    def offsets_for_times(
        self, tps: Collection[TopicPartition], timestamp_ms: int
    ) -> dict[TopicPartition, int | None]:
        return {tp: None for tp in tps}


class InProcess:
    """A stand-in executor: stage 1 over the planned records, then stage 2 per instance,
    in this process — the functions Spark runs, without Spark."""

    def __init__(self, log: Log) -> None:
        self.log = log
        self.executions = 0

    def prepare(self) -> None:
        pass

    def execute(
        self, plan: BatchPlan, stage: StageTwo, pending: pa.Table | None, watermark: int | None
    ) -> Execution:
        self.executions += 1
        rows: dict[str, list] = {c: [] for c in SOURCE_COLUMNS}
        for r in plan.ranges:
            for off in range(r.start, r.end):
                sent = self.log.values[TopicPartition(r.topic, r.partition)][off]
                key, value = sent if isinstance(sent, tuple) else (None, sent)  # (key, value)
                for column, cell in zip(
                    SOURCE_COLUMNS, (r.topic, r.partition, off, key, value), strict=True
                ):
                    rows[column].append(cell)
        by_instance: dict[int, list[pa.RecordBatch]] = defaultdict(list)
        if has_input(plan, pending):
            process = StageOne(stage.pipeline, stage.parallelism, watermark, stage.crash_at)
            kafka = pa.RecordBatch.from_pydict(rows)
            for batch in process([kafka]):  # as it crosses the exchange: kind, topic coded
                table = tags_of(stage.pipeline).from_wire(pa.Table.from_batches([batch]))
                for i in range(stage.parallelism):
                    by_instance[i].append(
                        table.filter(pa.compute.equal(table.column("instance"), i))
                    )
        results = []
        schema = exchange_schema(stage.pipeline)
        for i in range(stage.parallelism):
            parts = [*by_instance[i], ticks([i], schema)]
            table = pa.concat_tables([pa.table(p, schema=schema) for p in parts])
            out = stage((i,), table)
            results.append(InstanceResult.from_json(json.loads(out.column("result")[0].as_py())))
        return Execution(tuple(results), None)


@pytest.fixture
def log() -> Log:
    log = Log(partitions=2)
    log.produce(0, "ann", "bob", "ann")
    log.produce(1, "cid", "ann")
    return log


@pytest.fixture
def pipeline(tmp_path: Path) -> Pipeline:
    return Pipeline(
        name="counts",
        source=KafkaSource(topics=("clicks",)),
        key_by="user",
        process=CountPerUser(),
        sinks=[ParquetSink("totals", str(tmp_path / "totals"))],
        checkpoints=str(tmp_path / "checkpoints"),
        max_parallelism=8,
        parallelism=2,
    )


def runner(pipeline: Pipeline, log: Log) -> BatchRunner:
    settings = dataclasses.replace(Settings.from_env(), spark_master="local[1]")
    return BatchRunner(None, pipeline, settings, executor=InProcess(log), broker=log)


def totals(pipeline: Pipeline) -> list[tuple[str, int]]:
    table = read_parquet_sink(pipeline.sinks[0].url)  # type: ignore[attr-defined]
    if table.num_rows == 0:
        return []
    users, counts = table.column("user").to_pylist(), table.column("total").to_pylist()
    return sorted(zip(users, counts, strict=True))


def phase(pipeline: Pipeline, batch_id: int) -> Phase:
    return phase_of(open_store(pipeline.checkpoints), Layout(), batch_id)


def test_the_stand_in_broker_is_a_broker_view(log: Log) -> None:
    assert isinstance(log, BrokerView)


def test_a_batch_goes_from_new_to_published_and_records_what_it_did(pipeline, log) -> None:
    assert phase(pipeline, 0) is Phase.NEW

    result = runner(pipeline, log).run()

    assert (result.status, result.batch_id, result.records_in) == ("committed", 0, 5)
    assert result.outputs == {"totals": 3}
    assert phase(pipeline, 0) is Phase.PUBLISHED
    assert totals(pipeline) == [("ann", 3), ("bob", 1), ("cid", 1)]
    record = BatchRecord.of(latest_manifest(open_store(pipeline.checkpoints), Layout()))
    assert record.offsets == {("clicks", 0): 3, ("clicks", 1): 2}
    assert record.batch is not None and record.batch.base_checkpoint is None
    assert record.stats is not None and record.stats.records_in == 5
    assert sum(s.rows for s in record.sinks["totals"] if s) == 3  # type: ignore[index]


def test_the_batch_record_reads_back_as_the_manifest_wrote_it(pipeline, log) -> None:
    runner(pipeline, log).run()
    manifest = load_manifest(open_store(pipeline.checkpoints), Layout(), 0)

    record = BatchRecord.of(manifest)

    assert record.to_json() == json.loads(json.dumps(dict(manifest.metadata)))
    unknown = {**manifest.metadata, "future_field": {"x": 1}}
    assert BatchRecord.from_json(unknown, 0).to_json()["future_field"] == {"x": 1}


def test_a_crash_after_the_commit_is_published_by_the_next_run(pipeline, log) -> None:
    with pytest.raises(InjectedCrash):
        runner(pipeline, log).run(BatchOptions(crash_at="after_commit", run_id="r1"))
    assert phase(pipeline, 0) is Phase.COMMITTED
    assert totals(pipeline) == []  # committed, not visible yet

    log.produce(0, "bob")
    result = runner(pipeline, log).run(BatchOptions(run_id="r1"))

    assert result.recovered_publish == 0 and result.batch_id == 1
    assert totals(pipeline) == [("ann", 3), ("bob", 1), ("bob", 2), ("cid", 1)]


def test_a_crash_after_planning_replays_the_stored_plan(pipeline, log) -> None:
    with pytest.raises(InjectedCrash):
        runner(pipeline, log).run(BatchOptions(crash_at="after_plan", run_id="r1"))
    assert phase(pipeline, 0) is Phase.PLANNED

    log.produce(1, "dan")  # arrives after the plan: the next batch reads it
    result = runner(pipeline, log).run(BatchOptions(run_id="r1", parallelism=3))

    assert result.replayed and result.records_in == 5
    assert result.parallelism == 2  # the recorded parallelism, for the same files
    assert runner(pipeline, log).run().records_in == 1


def test_a_crash_after_staging_leaves_an_executed_batch_that_commits_once(pipeline, log) -> None:
    with pytest.raises(InjectedCrash):
        runner(pipeline, log).run(BatchOptions(crash_at="after_sink_staging", run_id="r1"))
    assert phase(pipeline, 0) is Phase.EXECUTED

    result = runner(pipeline, log).run(BatchOptions(run_id="r1"))

    assert result.replayed and phase(pipeline, 0) is Phase.PUBLISHED
    assert totals(pipeline) == [("ann", 3), ("bob", 1), ("cid", 1)]


def test_a_batch_without_new_records_commits_an_empty_checkpoint(pipeline, log) -> None:
    first = runner(pipeline, log)
    first.run()
    executor = first.executor

    result = BatchRunner(None, pipeline, first.settings, executor=executor, broker=log).run()

    assert (result.batch_id, result.records_in, result.outputs) == (1, 0, {"totals": 0})
    assert totals(pipeline) == [("ann", 3), ("bob", 1), ("cid", 1)]


def test_a_stale_attempt_cannot_commit_a_checkpoint_retention_already_removed(
    pipeline, log
) -> None:
    """An attempt that stalled before batch 0 and wakes after batches 0-2 committed and
    retention removed manifest 0 must not commit checkpoint 0 a second time."""
    short = dataclasses.replace(pipeline, retain_checkpoints=1)
    for _ in range(3):
        log.produce(0, "ann")
        runner(short, log).run()
    store = open_store(short.checkpoints)
    assert [phase(short, b) for b in (0, 2)] == [Phase.NEW, Phase.PUBLISHED]  # 0 is gone

    stale = runner(short, log)
    with pytest.raises(BatchError, match=r"started from checkpoint None, but the newest is now 2"):
        stale.commit("pipeline 'counts' batch 0", None, 0, BatchRecord(), [])
    assert [m.checkpoint_id for m in [latest_manifest(store, Layout())] if m] == [2]


def test_a_new_checkpoint_location_refuses_sinks_that_already_published(
    pipeline, log, tmp_path
) -> None:
    """Batch ids start at 0 again with new checkpoints: the Parquet sink's commit entries
    of batches 0.. would be overwritten, so the first batch refuses to start."""
    runner(pipeline, log).run()
    moved = dataclasses.replace(pipeline, checkpoints=str(tmp_path / "elsewhere"))

    with pytest.raises(CheckpointError, match=r"sink 'totals' already published batches up to 0"):
        runner(moved, log).run()
    assert totals(pipeline) == [("ann", 3), ("bob", 1), ("cid", 1)]  # untouched


def test_a_stored_plan_whose_records_retention_deleted_is_replanned_not_wedged(
    pipeline, log
) -> None:
    """A crash after planning, then Kafka's retention deletes the start of a planned
    range: replaying the plan would fail forever. The run says so, naming the offsets;
    with --replan the batch is planned again and the loss is recorded."""
    with pytest.raises(InjectedCrash):
        runner(pipeline, log).run(BatchOptions(crash_at="after_plan", run_id="r1"))
    log.start[TopicPartition("clicks", 0)] = 2  # offsets 0-1 of partition 0 are gone

    with pytest.raises(SourceError, match=r"clicks\[0\] \[0, 2\).* --replan"):
        runner(pipeline, log).run(BatchOptions(run_id="r1"))
    result = runner(pipeline, log).run(BatchOptions(run_id="r1", replan=True))

    assert (result.batch_id, result.records_in, result.replayed) == (0, 3, False)
    record = BatchRecord.of(latest_manifest(open_store(pipeline.checkpoints), Layout()))
    assert record.stats is not None and record.stats.skipped == {"clicks": {"0": 2}}
    assert totals(pipeline) == [("ann", 2), ("cid", 1)]  # partition 0's "ann" at 2, p1 both


def test_a_batch_of_a_past_data_interval_runs_on_the_interval_clock(pipeline, log) -> None:
    """TTL expiry and idle partitions are decided at the interval's end, so a backfill of
    the interval decides them exactly as its scheduled run did, whenever it runs."""
    interval_end = 1_700_000_000_000  # long past

    runner(pipeline, log).run(BatchOptions(until_timestamp_ms=interval_end))

    record = BatchRecord.of(latest_manifest(open_store(pipeline.checkpoints), Layout()))
    assert record.batch is not None and record.batch.processing_time_ms == interval_end


def test_files_of_an_attempt_that_lost_the_commit_go_when_the_batch_leaves_retention(
    pipeline, log
) -> None:
    short = dataclasses.replace(pipeline, retain_checkpoints=1)
    with pytest.raises(InjectedCrash):
        runner(short, log).run(BatchOptions(crash_at="after_sink_staging", run_id="r1"))
    runner(short, log).run(BatchOptions(run_id="r1"))  # a new attempt commits batch 0
    sink = open_store(short.sinks[0].url)  # type: ignore[attr-defined]
    listed = set(json.loads(sink.get(ps.commit_key(0)))["files"])
    orphans = set(sink.list(ps.batch_prefix(0))) - listed
    assert orphans, "the crashed attempt's parts should be left over"

    log.produce(0, "bob")
    runner(short, log).run()  # batch 1: batch 0 leaves retention

    assert set(sink.list(ps.batch_prefix(0))) == listed
    assert totals(short) == [("ann", 3), ("bob", 1), ("bob", 2), ("cid", 1)]


def test_a_declared_schema_gives_the_same_totals_as_decoding_per_record(
    pipeline, log, tmp_path
) -> None:
    declared = dataclasses.replace(
        pipeline,
        source=KafkaSource(topics=("clicks",), value_schema=JsonSchema({"user": "string"})),
        sinks=[ParquetSink("totals", str(tmp_path / "declared"))],
        checkpoints=str(tmp_path / "declared-checkpoints"),
    )
    runner(pipeline, log).run()
    runner(declared, log).run()
    assert totals(declared) == totals(pipeline) == [("ann", 3), ("bob", 1), ("cid", 1)]

    log.produce(0, "ann", "dan")
    log.values[TopicPartition("clicks", 1)].append(b'{"user": 7}')  # a number, not a string
    result = runner(declared, log).run()

    assert (result.records_in, result.dead_letters) == (3, 1)
    assert result.dead_letter_reasons == {"schema_mismatch": 1}
    assert totals(declared) == [("ann", 3), ("ann", 4), ("bob", 1), ("cid", 1), ("dan", 1)]


def test_a_second_pipeline_in_the_same_checkpoint_location_is_refused_before_any_work(
    pipeline, log, tmp_path
) -> None:
    """Pipeline 'orders' given the checkpoint location of 'counts', where a plan of batch 0
    is stored (a dry run, or a crash after planning): replaying it would read 'clicks' and
    commit it as an 'orders' batch."""
    runner(pipeline, log).run(BatchOptions(dry_run=True))  # stores the plan of batch 0
    orders = dataclasses.replace(
        pipeline,
        name="orders",
        source=KafkaSource(topics=("orders",)),
        sinks=[ParquetSink("totals", str(tmp_path / "orders"))],
    )
    second = runner(orders, log)

    refused = r"pipeline 'orders': .* plan of batch 0 of pipeline 'counts' .*share this location"
    with pytest.raises(ConfigError, match=refused):
        second.run()

    assert second.executor.executions == 0  # type: ignore[attr-defined]
    assert phase(pipeline, 0) is Phase.PLANNED and totals(orders) == []
    assert runner(pipeline, log).run().records_in == 5  # 'counts' goes on with its plan


def test_a_parquet_output_another_pipeline_owns_is_refused_before_a_first_batch(
    pipeline, log, tmp_path
) -> None:
    runner(pipeline, log).run()  # 'counts' published batch 0 to tmp_path/totals
    orders = dataclasses.replace(
        pipeline, name="orders", checkpoints=str(tmp_path / "orders-checkpoints")
    )
    second = runner(orders, log)

    owned = r"pipeline 'orders': the Parquet output .*/totals belongs to pipeline 'counts'"
    with pytest.raises(ConfigError, match=owned):
        second.run()
    assert second.executor.executions == 0  # type: ignore[attr-defined]


def test_a_parquet_output_another_pipeline_published_to_meanwhile_is_refused_at_publish(
    pipeline, log, tmp_path
) -> None:
    """Both pipelines found the output empty before their first batch; 'counts' published
    batch 0 between the commit and the publish of 'orders', whose entry would have been
    taken as its own: 'orders' would report rows no reader ever sees."""
    orders = dataclasses.replace(
        pipeline, name="orders", checkpoints=str(tmp_path / "orders-checkpoints")
    )
    with pytest.raises(InjectedCrash):
        runner(orders, log).run(BatchOptions(crash_at="after_commit", run_id="o1"))
    runner(pipeline, log).run()

    owned = r"pipeline 'orders': the Parquet output .*/totals belongs to pipeline 'counts'"
    with pytest.raises(ConfigError, match=owned):
        runner(orders, log).run(BatchOptions(run_id="o1"))  # publishes its batch 0 first
    assert phase(orders, 0) is Phase.COMMITTED  # never marked published
    assert totals(pipeline) == [("ann", 3), ("bob", 1), ("cid", 1)]  # only 'counts' rows
