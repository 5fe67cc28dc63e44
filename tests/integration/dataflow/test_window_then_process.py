"""A window as the first keyed step, its rows re-keyed into a process function with
timers: the window's rows carry their window's time downstream — from records as
payloads, and from a declared schema, where stage 1 pre-aggregates the window."""

from __future__ import annotations

import json
from collections import defaultdict
from typing import Any

import pytest

from microbatch import windows
from microbatch.dataflow import Dataflow
from microbatch.runtime import (
    BatchOptions,
    BatchRunner,
    EventTime,
    JsonSchema,
    KafkaSource,
    KeyedProcessFunction,
    ParquetSink,
    windowed,
)
from microbatch.sinks import read_parquet_sink
from tests.integration.runtime.test_batches import new_topic, produce

pytestmark = pytest.mark.integration


class BusiestWindow(KeyedProcessFunction):
    """Per window start (all cards): remembers the largest sum; reports it when the
    watermark passes the window (a timer at the window's end)."""

    def process(self, key: Any, records: Any, ctx: Any) -> None:
        best = ctx.value("best")
        for r in records:
            if r["sum_amount"] > best.get({"sum_amount": -1})["sum_amount"]:
                best.set({"card": r["key"], "sum_amount": r["sum_amount"]})
            ctx.register_timer(r["window_end"])

    def on_timer(self, key: Any, timestamp_ms: int, ctx: Any) -> None:
        ctx.emit({"window_start": key, **ctx.value("best").get()})


@pytest.mark.parametrize("declared", [False, True], ids=["payloads", "declared-schema"])
def test_window_rows_flow_into_a_keyed_step_with_timers(
    spark, kafka_settings, bootstrap, admin, tmp_path, declared: bool
) -> None:
    values = [
        json.dumps({"card": f"c{i % 5}", "amount": (i * 7) % 50 + i % 5, "ts": 1_000 * i}).encode()
        for i in range(100)
    ]
    topic = new_topic(admin, 2)
    produce(bootstrap, topic, values)
    schema = JsonSchema({"card": "string", "amount": "long", "ts": "long"}) if declared else None
    flow = Dataflow(
        "busiest",
        checkpoints=f"{tmp_path}/checkpoints",
        event_time=EventTime(field="ts", idle_timeout_s=None),
        max_parallelism=8,
        parallelism=2,
    )
    per_card = (
        flow.source(KafkaSource(topics=(topic,), max_records_per_batch=40, value_schema=schema))
        .key_by("card")
        .window(
            windows.tumbling("10s").sum("amount").collect("amount")
            .aggregate("distinct", "amount", init=list, add=lambda a, v: sorted({*a, v}),
                       merge=lambda a, b: sorted({*a, *b}), result=len, pre_aggregate=True)
            .final(),
            uid="per-card",
        )  # custom and collect partials cross the exchange too
    )  # fmt: skip
    per_card.to(ParquetSink("per-card", f"{tmp_path}/per-card"))
    (
        per_card.key_by("window_start")
        .process(BusiestWindow(), uid="busiest")
        .to(ParquetSink("busiest", f"{tmp_path}/busiest"))
    )
    pipeline = flow.build()
    assert (windowed.pre_aggregation(pipeline) is not None) == declared
    results = [
        BatchRunner(spark, pipeline, kafka_settings).run(BatchOptions(run_id=f"r{i}"))
        for i in range(4)
    ]
    watermark = results[-1].watermark
    sums: dict[int, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    amounts: dict[tuple[str, int], list[int]] = defaultdict(list)  # in event-time order
    for v in values:
        p = json.loads(v)
        sums[p["ts"] // 10_000 * 10_000][p["card"]] += p["amount"]
        amounts[p["card"], p["ts"] // 10_000 * 10_000].append(p["amount"])
    want = []
    for start, cards in sorted(sums.items()):
        if start + 10_000 <= watermark:  # the window closed, and its timer downstream fired
            card, total = max(cards.items(), key=lambda kv: (kv[1], -int(kv[0][1:])))
            want.append({"window_start": start, "card": card, "sum_amount": total})
    got = read_parquet_sink(str(tmp_path / "busiest")).to_pylist()
    got = sorted(got, key=lambda r: r["window_start"])
    assert len(want) >= 5
    assert [(r["window_start"], r["sum_amount"]) for r in got] == [
        (r["window_start"], r["sum_amount"]) for r in want
    ]
    windows_out = read_parquet_sink(str(tmp_path / "per-card")).to_pylist()
    assert len(windows_out) >= 25
    for r in windows_out:
        mine = amounts[r["key"], r["window_start"]]
        assert (r["collect_amount"], r["distinct"]) == (mine, len(set(mine))), r
