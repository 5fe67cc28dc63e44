"""Windows pre-aggregated in stage 1 (local-global aggregation) through the whole batch
protocol — real stage 1 per source partition, as Spark's tasks run it, and stage 2 —
give the same windows and the same dead letters as the records path, batch by batch."""

from __future__ import annotations

import dataclasses
import json
import random
from collections import defaultdict
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pytest

from microbatch import windows
from microbatch.kafka import BatchPlan, TopicPartition
from microbatch.runtime import (
    BatchRunner,
    DeadLetterSink,
    EventTime,
    JsonSchema,
    KafkaSource,
    ParquetSink,
    Pipeline,
    windowed,
)
from microbatch.runtime.envelope import PARTIAL, RECORD, SOURCE_COLUMNS, ticks
from microbatch.runtime.execute import Execution, has_input
from microbatch.runtime.records import InstanceResult
from microbatch.runtime.stage_one import StageOne
from microbatch.runtime.stage_two import StageTwo
from microbatch.settings import Settings
from microbatch.sinks import read_parquet_sink
from tests.unit.runtime.test_protocol import InProcess, Log

MIN = 60_000
SCHEMA = JsonSchema(
    {"user": "string", "ts": "long", "amount": "long", "price": "double"},
    nullable=("amount",),
)


class PerPartition(InProcess):
    """Stage 1 with one Arrow batch per planned range (a Spark task each: partials are
    per task), then stage 2 per instance; counts the kinds of rows exchanged."""

    def __init__(self, log: Log) -> None:
        super().__init__(log)
        self.kinds: dict[str, int] = defaultdict(int)

    def execute(
        self, plan: BatchPlan, stage: StageTwo, pending: pa.Table | None, watermark: int | None
    ) -> Execution:
        schema = windowed.exchange_schema(stage.pipeline)
        exchanged: list[pa.Table] = []
        if has_input(plan, pending):
            ranges = []
            for r in plan.ranges:
                values = self.log.values[TopicPartition(r.topic, r.partition)][r.start : r.end]
                cols = (
                    [r.topic] * len(values), [r.partition] * len(values),
                    list(range(r.start, r.end)), [None] * len(values), values,
                )  # fmt: skip
                ranges.append(
                    pa.RecordBatch.from_pydict(dict(zip(SOURCE_COLUMNS, cols, strict=True)))
                )
            process = StageOne(stage.pipeline, stage.parallelism, watermark, stage.crash_at)
            exchanged = [pa.Table.from_batches([b]) for b in process(ranges)]
        results = []
        for i in range(stage.parallelism):
            mine = [t.filter(pc.equal(t.column("instance"), i)) for t in exchanged]
            table = pa.concat_tables(
                [*(pa.table(t, schema=schema) for t in mine), ticks([i], schema)]
            )
            for kind in table.column("kind").to_pylist():
                self.kinds[kind] += 1
            out = stage((i,), table)
            results.append(InstanceResult.from_json(json.loads(out.column("result")[0].as_py())))
        return Execution(tuple(results), None)


def produce(log: Log, seed: int, start: int, n: int) -> None:
    """Out-of-order events over two partitions, event times on a 1 s grid (ties across
    partitions), some null amounts, and a few far behind any watermark."""
    rng = random.Random(seed)
    for i in range(n):
        ts = (start + i * 1_500 - rng.choice([0, 0, rng.randrange(3 * MIN)])) // 1_000 * 1_000
        amount = None if rng.random() < 0.1 else rng.randrange(100)
        event = {"user": f"u{rng.randrange(5)}", "ts": ts, "amount": amount, "price": i / 7}
        log.values[TopicPartition("clicks", i % 2)].append(json.dumps(event).encode())
    for p in (0, 1):
        late = {"user": "u1", "ts": start // 4, "amount": 1, "price": 0.5}
        log.values[TopicPartition("clicks", p)].append(json.dumps(late).encode())


KINDS = {
    "tumbling": lambda: windows.tumbling("1m").count().sum("amount").min("amount").max("price")
    .mean("amount").first("amount").last("amount").final(allowed_lateness="10s"),
    "hopping": lambda: windows.hopping("2m", every="1m").sum("amount").max("price")
    .last("price").updates(),
    "session": lambda: windows.session(gap="3s").count().first("price").max("amount").final(),
    "session updates": lambda: windows.session(gap="2s").count().last("amount").updates(),
}  # fmt: skip


def run_all(tmp_path: Path, kind: str, on: bool) -> tuple[list, list, dict[str, int]]:
    windowed.PRE_AGGREGATE = on
    log = Log(partitions=2)
    pipeline = Pipeline(
        name="windows",
        source=KafkaSource(topics=("clicks",), value_schema=SCHEMA),
        key_by="user",
        process=KINDS[kind](),
        event_time=EventTime("ts", idle_timeout_s=None),
        sinks=[ParquetSink("out", str(tmp_path / "out"))],
        dead_letters=DeadLetterSink(path=str(tmp_path / "dead"), max_ratio=1.0),
        checkpoints=str(tmp_path / "checkpoints"),
        max_parallelism=8,
        parallelism=2,
    )
    settings = dataclasses.replace(Settings.from_env(), spark_master="local[1]")
    executor = PerPartition(log)
    out = []
    for n in range(4):
        produce(log, seed=n, start=n * 240_000, n=160)
        BatchRunner(None, pipeline, settings, executor=executor, broker=log).run()
        rows = read_parquet_sink(str(tmp_path / "out")).to_pylist()
        out.append(sorted(json.dumps(r, sort_keys=True) for r in rows))  # batch by batch
    dead = read_parquet_sink(str(tmp_path / "dead")).to_pylist()
    fields = ("reason", "error", "topic", "partition", "offset", "raw_key", "raw_value", "step")
    return out, sorted(tuple(d[f] for f in fields) for d in dead), dict(executor.kinds)


@pytest.fixture(autouse=True)
def _restore_switch():
    before = windowed.PRE_AGGREGATE
    yield
    windowed.PRE_AGGREGATE = before


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_pre_aggregated_windows_equal_the_records_path_batch_by_batch(
    tmp_path: Path, kind: str
) -> None:
    want_out, want_dead, plain = run_all(tmp_path / "records", kind, on=False)
    got_out, got_dead, reduced = run_all(tmp_path / "partials", kind, on=True)

    assert plain.get(RECORD) and not plain.get(PARTIAL)
    assert reduced.get(PARTIAL) and not reduced.get(RECORD)  # only partials crossed
    assert reduced[PARTIAL] < plain[RECORD]
    assert len(want_out[-1]) > 10 and want_dead  # windows emitted, late records
    assert {d[0] for d in want_dead} == {"late_window"}
    assert got_out == want_out
    assert got_dead == want_dead


def test_windows_that_cannot_be_merged_exactly_are_not_pre_aggregated(tmp_path: Path) -> None:
    def made(process) -> Pipeline:
        return Pipeline(
            name="windows",
            source=KafkaSource(topics=("clicks",), value_schema=SCHEMA),
            key_by="user",
            process=process,
            event_time=EventTime("ts", idle_timeout_s=None),
            sinks=[ParquetSink("out", str(tmp_path / "out"))],
            checkpoints=str(tmp_path / "checkpoints"),
        )

    assert windowed.pre_aggregation(made(windows.tumbling("1m").sum("amount").final()))
    float_sum = made(windows.tumbling("1m").mean("price").final())  # order-dependent bits
    collect = made(windows.tumbling("1m").collect("amount").final())
    for pipeline in (float_sum, collect):
        assert windowed.pre_aggregation(pipeline) is None
        assert windowed.exchange_schema(pipeline).names[-1] == "value_price"
    schemaless = dataclasses.replace(float_sum, source=KafkaSource(topics=("clicks",)))
    assert windowed.pre_aggregation(schemaless) is None
