"""Dataflows without keyed steps — source → where/select → sinks — on real Kafka and
Spark: the sinks' output equals a plain-Python reference, the same as the record-wise
dataflow (filter/map) gives, and stays so across a crash inside a batch and a rescale."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pytest

from microbatch.dataflow import Dataflow
from microbatch.runtime import (
    BatchOptions,
    BatchRunner,
    DeadLetterSink,
    JsonSchema,
    KafkaSource,
    ParquetSink,
    Pipeline,
)
from microbatch.runtime.column_plan import tap_values
from microbatch.sinks import read_parquet_sink
from tests.integration.runtime.test_batches import new_topic, produce

pytestmark = pytest.mark.integration

SCHEMA = JsonSchema({"auction": "long", "bidder": "long", "price": "long"}, nullable=("bidder",))
N = 90
BAD = {17, 50}  # values that do not match the schema: dead letters
EUROS = pa.schema([("auction", pa.int64()), ("euros", pa.float64())])


def value(i: int) -> bytes:
    if i in BAD:
        return json.dumps({"auction": i, "price": "free"}).encode()
    return json.dumps({"auction": i * 41, "bidder": i % 4 or None, "price": 100 + i}).encode()


def reference() -> dict[str, list[dict[str, Any]]]:
    """The sinks' rows, computed in Python."""
    bids = [json.loads(value(i)) for i in range(N) if i not in BAD]
    q2 = [{"auction": b["auction"], "price": b["price"]} for b in bids if b["auction"] % 123 == 0]
    q1 = [
        {"auction": b["auction"], "euros": b["price"] * 0.908}
        for b in bids
        if b["bidder"] is not None
    ]
    return {"q2": q2, "q1": q1}


@pytest.fixture(scope="module")
def topic(bootstrap, admin) -> str:
    name = new_topic(admin, 2)
    produce(bootstrap, name, [value(i) for i in range(N)])
    return name


def dataflow(
    topic: str, root: Path, columns: bool, reader: str = "auto", most: int | None = 30
) -> Pipeline:
    flow = Dataflow("etl", checkpoints=f"{root}/checkpoints", max_parallelism=8, parallelism=2,
                    dead_letters=DeadLetterSink(path=f"{root}/dead"))  # fmt: skip
    bids = flow.source(KafkaSource(topics=(topic,), value_schema=SCHEMA, max_records_per_batch=most,
                                   reader=reader))  # type: ignore[arg-type]  # fmt: skip
    q2, q1 = ParquetSink("q2", f"{root}/q2"), ParquetSink("q1", f"{root}/q1", schema=EUROS)
    if columns:
        auction = pc.field("auction")
        bids.where(auction - auction / 123 * 123 == 0).select("auction", "price").to(q2)
        bids.where(pc.field("bidder").is_valid()).select(
            "auction", euros=pc.field("price") * 0.908
        ).to(q1)
    else:
        bids.filter(lambda b: b["auction"] % 123 == 0).map(
            lambda b: {"auction": b["auction"], "price": b["price"]}
        ).to(q2)
        bids.filter(lambda b: b["bidder"] is not None).map(
            lambda b: {"auction": b["auction"], "euros": b["price"] * 0.908}
        ).to(q1)
    return flow.build()


def output(root: Path) -> dict[str, list[dict[str, Any]]]:
    return {
        name: sorted(read_parquet_sink(str(root / name)).to_pylist(), key=lambda r: r["auction"])
        for name in ("q2", "q1")
    }


def dead_offsets(root: Path) -> list[tuple[int, int]]:
    rows = read_parquet_sink(str(root / "dead")).to_pylist()
    return sorted((r["partition"], r["offset"]) for r in rows)


@pytest.mark.parametrize(
    ("columns", "crash_at", "reader"),
    [
        (False, None, "auto"),
        (True, None, "auto"),
        (True, "during_read", "auto"),
        (True, "after_state_files", "auto"),
        (True, "after_sink_staging", "auto"),
        (True, "after_state_files", "spark"),
    ],
    ids=[
        "records",
        "columns",
        "columns-crash-reading",
        "columns-crash-after-state",
        "columns-crash-after-staging",
        "columns-jvm-reader-two-stages",
    ],
)
def test_a_sink_only_dataflow_equals_the_reference_across_a_crash_and_a_rescale(
    columns: bool, crash_at: str | None, reader: str, spark, kafka_settings, topic: str,
    tmp_path: Path,
) -> None:  # fmt: skip
    pipeline = dataflow(topic, tmp_path, columns, reader)
    assert (tap_values(pipeline) is not None) == columns
    runner = BatchRunner(spark, pipeline, kafka_settings)
    runner.run(BatchOptions(run_id="a"))
    if crash_at is not None:
        with pytest.raises(Exception, match="injected crash"):
            runner.run(BatchOptions(run_id="b", crash_at=crash_at))
    results = [runner.run(BatchOptions(run_id="b", parallelism=3))]  # rescaled 2 → 3
    results += [runner.run(BatchOptions(run_id=f"c{i}", parallelism=1)) for i in range(2)]

    want = reference()
    assert output(tmp_path) == {k: sorted(v, key=lambda r: r["auction"]) for k, v in want.items()}
    assert len(dead_offsets(tmp_path)) == len(BAD)
    assert sum(r.records_in for r in results) + 30 == N  # the first batch read 30
    assert results[-1].lag == {} or set(results[-1].lag.values()) == {0}


@pytest.fixture(scope="module")
def three_partitions(bootstrap, admin) -> str:
    """The values spread over three partitions, round robin."""
    from kafka import KafkaProducer

    name = new_topic(admin, 3)
    producer = KafkaProducer(bootstrap_servers=bootstrap, acks="all")
    try:
        for i in range(N):
            producer.send(name, value=value(i), partition=i % 3)
        producer.flush()
    finally:
        producer.close()
    return name


@pytest.mark.parametrize("reader", ["native", "confluent", "python"])
def test_a_sink_only_batch_is_one_spark_stage_without_an_exchange(
    reader: str, spark, kafka_settings, three_partitions: str, tmp_path: Path
) -> None:
    """No record meets another, so nothing crosses an exchange: each instance's task reads
    its ranges and stages its own output; the batch's totals are the instances' sum."""
    pipeline = dataflow(three_partitions, tmp_path, columns=True, reader=reader, most=None)
    runner = BatchRunner(spark, pipeline, kafka_settings)
    group = f"one-stage-{tmp_path.name}"
    spark.sparkContext.setJobGroup(group, "one sink-only batch")
    try:
        result = runner.run(BatchOptions(run_id="one"))
    finally:
        spark.sparkContext.setJobGroup("", "")
    plan = runner.executor.last_frame._jdf.queryExecution().executedPlan().toString()
    assert "Exchange" not in plan, plan
    tracker = spark.sparkContext.statusTracker()
    jobs = tracker.getJobIdsForGroup(group)
    stages = [s for j in jobs for s in tracker.getJobInfo(j).stageIds]
    assert len(stages) == 1, f"a sink-only batch ran Spark stages {stages}"
    # Each instance read its partitions (two and one) and counted only their records: the
    # batch's totals are the sum.
    assert len(result.ranges) == 3
    assert result.records_in == sum(r["until"] - r["from"] for r in result.ranges) == N
    assert result.dead_letters == len(BAD)
    assert output(tmp_path) == {
        k: sorted(v, key=lambda r: r["auction"]) for k, v in reference().items()
    }
