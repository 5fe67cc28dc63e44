"""Processing-time timers: they fire in the first batch whose recorded processing time
(the plan's) passes them — so a rerun of that batch fires the same timers at the same
time — and what they emit flows on to the next keyed step."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from microbatch.checkpoint import Layout, load_manifest
from microbatch.dataflow import Dataflow
from microbatch.runtime import (
    BatchOptions,
    BatchRunner,
    KafkaSource,
    KeyedProcessFunction,
    ParquetSink,
)
from microbatch.runtime.records import BatchRecord
from microbatch.sinks import read_parquet_sink
from microbatch.storage import open_store
from tests.integration.runtime.test_batches import new_topic, produce

pytestmark = pytest.mark.integration


class RemindLater(KeyedProcessFunction):
    """A reminder 1 ms of processing time after a card's first payment."""

    def process(self, key: Any, records: Any, ctx: Any) -> None:
        if not ctx.processing_timers():
            ctx.register_processing_timer(ctx.processing_time_ms + 1)

    def on_timer(self, key: Any, timestamp_ms: int, ctx: Any) -> None:
        ctx.emit({"card": key, "due": timestamp_ms, "domain": ctx.time_domain,
                  "at": ctx.processing_time_ms, "region": key[-1]})  # fmt: skip


class CountPerRegion(KeyedProcessFunction):
    def process(self, key: Any, records: Any, ctx: Any) -> None:
        for r in records:
            ctx.emit(r)


def reminders(topic: str, root: Path):
    flow = Dataflow("reminders", checkpoints=f"{root}/checkpoints", max_parallelism=8,
                    parallelism=2)  # fmt: skip
    (
        flow.source(KafkaSource(topics=(topic,)))
        .key_by("card")
        .process(RemindLater(), uid="remind")
        .key_by("region")
        .process(CountPerRegion(), uid="regions")
        .to(ParquetSink("reminders", f"{root}/reminders"))
    )
    return flow.build()


def processing_time_of(root: Path, batch_id: int) -> int:
    manifest = load_manifest(open_store(str(root / "checkpoints")), Layout(), batch_id)
    return BatchRecord.of(manifest).batch.processing_time_ms


@pytest.fixture(scope="module")
def topic(bootstrap, admin) -> str:
    name = new_topic(admin, 2)
    produce(bootstrap, name, [json.dumps({"card": f"c{i % 6}"}).encode() for i in range(30)])
    return name


@pytest.mark.parametrize("crash_at", [None, "after_commit"])
def test_processing_timers_fire_in_the_next_batch_and_a_rerun_fires_the_same(
    crash_at, spark, kafka_settings, topic, tmp_path
) -> None:
    pipe = reminders(topic, tmp_path)
    first = BatchRunner(spark, pipe, kafka_settings).run(BatchOptions(run_id="a"))
    assert first.records_in == 30
    assert (
        not (tmp_path / "reminders").exists()
        or not read_parquet_sink(str(tmp_path / "reminders")).num_rows
    )  # registered in batch 0, at its processing time + 1: not due yet
    if crash_at is not None:
        with pytest.raises(Exception, match="injected crash"):
            BatchRunner(spark, pipe, kafka_settings).run(
                BatchOptions(run_id="b", crash_at=crash_at)
            )
    BatchRunner(spark, pipe, kafka_settings).run(BatchOptions(run_id="b"))
    fired_at = processing_time_of(tmp_path, 1)  # the batch after the timers' own
    rows = sorted(read_parquet_sink(str(tmp_path / "reminders")).to_pylist(),
                  key=lambda r: r["card"])  # fmt: skip
    assert [r["card"] for r in rows] == [f"c{i}" for i in range(6)]
    assert {r["domain"] for r in rows} == {"processing_time"}
    assert {r["at"] for r in rows} == {fired_at}
    assert all(r["due"] < fired_at for r in rows)
    third = BatchRunner(spark, pipe, kafka_settings).run(BatchOptions(run_id="c"))
    assert third.outputs.get("reminders", 0) == 0  # each fired once
