"""Windows on the real runtime (Kafka, Spark, local checkpoints): out-of-order events over
two partitions, a rescale between batches, late records; the emitted windows equal a
plain-Python computation with the same watermark rule (a record is late when its window
had closed)."""

from __future__ import annotations

import collections
import json
import random
from pathlib import Path

import pytest

from microbatch import windows
from microbatch.runtime import (
    BatchOptions,
    BatchRunner,
    DeadLetterSink,
    EventTime,
    JsonSchema,
    KafkaSource,
    ParquetSink,
    Pipeline,
)
from microbatch.sinks import read_parquet_sink
from tests.integration.runtime.test_batches import new_topic, produce

pytestmark = pytest.mark.integration
MIN = 60_000


def events(n: int, start: int, seed: int) -> list[bytes]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        ts = start + i * 3_000 - rng.choice([0, 0, rng.randrange(4 * MIN)])
        out.append(
            json.dumps({"user": f"u{rng.randrange(5)}", "ts": ts, "amount": rng.randrange(9)})
        )
    return [e.encode() for e in out]


#: Declared: the values travel as columns, and stage 1 pre-aggregates the windows.
SCHEMA = JsonSchema({"user": "string", "ts": "long", "amount": "long"})


@pytest.mark.parametrize("declared", [False, True], ids=["records", "pre-aggregated"])
def test_tumbling_windows_equal_plain_python_across_batches_and_a_rescale(
    spark, kafka_settings, bootstrap, admin, tmp_path: Path, declared: bool
) -> None:
    topic = new_topic(admin, 2)
    pipeline = Pipeline(
        name="windows",
        source=KafkaSource(topics=(topic,), value_schema=SCHEMA if declared else None),
        key_by="user",
        process=windows.tumbling("1m")
        .count()
        .sum("amount")
        .collect("amount")
        .aggregate(
            "distinct",
            "amount",
            init=list,
            add=lambda a, v: sorted({*a, v}),
            merge=lambda a, b: sorted({*a, *b}),
            result=len,
            pre_aggregate=True,
        )
        .final(),  # collect and a custom aggregate: pre-aggregated too when declared
        event_time=EventTime("ts", idle_timeout_s=None),
        sinks=[ParquetSink("out", str(tmp_path / "out"))],
        dead_letters=DeadLetterSink(path=str(tmp_path / "dead"), max_ratio=1.0),
        checkpoints=str(tmp_path / "checkpoints"),
        max_parallelism=16,
        parallelism=2,
    )
    batches = [events(120, 0, seed=1), events(120, 300_000, seed=2)]
    flush = [json.dumps({"user": f"z{i}", "ts": 10**12, "amount": 0}).encode() for i in range(8)]
    watermark, late, windows_of = None, [], collections.defaultdict(list)
    for n, values in enumerate([*batches, flush]):
        placed = produce(bootstrap, topic, values)
        highest: dict[int, int] = {}
        for (partition, offset), v in zip(placed, values, strict=True):
            e = json.loads(v)
            start = e["ts"] - e["ts"] % MIN
            if watermark is not None and start + MIN <= watermark:  # its window had closed
                late.append(e)
            else:
                windows_of[e["user"], start].append((e["ts"], partition, offset, e["amount"]))
            highest[partition] = max(highest.get(partition, e["ts"]), e["ts"])
        BatchRunner(spark, pipeline, kafka_settings).run(
            BatchOptions(run_id=f"r{n}", parallelism=2 + n % 2)  # 2, 3, 2
        )
        assert len(highest) == 2, "both partitions got events"
        watermark = max(watermark or 0, min(highest.values()))

    out = read_parquet_sink(str(tmp_path / "out")).to_pylist()
    got = sorted(
        (r["key"], r["window_start"], r["count"], r["sum_amount"], r["collect_amount"],
         r["distinct"])
        for r in out
    )  # fmt: skip
    expected = []
    for (user, start), records in windows_of.items():
        amounts = [r[-1] for r in sorted(records)]  # event time, then source order
        if start + MIN <= watermark:
            expected.append((user, start, len(amounts), sum(amounts), amounts, len(set(amounts))))
    expected.sort()
    assert late, "the test has late events"
    assert got == expected
    dead = read_parquet_sink(str(tmp_path / "dead")).to_pylist()
    assert sorted(d["reason"] for d in dead) == ["late_window"] * len(late)


@pytest.mark.parametrize("declared", [False, True], ids=["records", "pre-aggregated"])
def test_a_window_open_across_batches_keeps_every_batch_s_records(
    spark, kafka_settings, bootstrap, admin, tmp_path: Path, declared: bool
) -> None:
    """Batch 2 adds to a window batch 1 opened, before the watermark reaches its end: the
    key's open windows must be loaded though its timer is not due, or batch 1's count is
    overwritten by batch 2's."""
    topic = new_topic(admin, 1)
    pipeline = Pipeline(
        name="open-windows",
        source=KafkaSource(topics=(topic,), value_schema=SCHEMA if declared else None),
        key_by="user",
        process=windows.tumbling("1m").count().sum("amount").final(),
        event_time=EventTime("ts", idle_timeout_s=None),
        sinks=[ParquetSink("out", str(tmp_path / "out"))],
        checkpoints=str(tmp_path / "checkpoints"),
        max_parallelism=16,
        parallelism=2,
    )
    batches = [[(1_000, 1), (2_000, 2)], [(3_000, 4)], [(10**12, 0)]]
    for n, batch in enumerate(batches):
        values = [json.dumps({"user": "u", "ts": ts, "amount": a}).encode() for ts, a in batch]
        produce(bootstrap, topic, values)
        BatchRunner(spark, pipeline, kafka_settings).run(BatchOptions(run_id=f"r{n}"))

    out = read_parquet_sink(str(tmp_path / "out")).to_pylist()
    assert [(r["window_start"], r["count"], r["sum_amount"]) for r in out] == [(0, 3, 7)]
