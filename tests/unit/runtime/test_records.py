"""Stage 1 without Spark: every Kafka row becomes exactly one record or dead letter."""

from __future__ import annotations

import json

import pyarrow as pa

from microbatch.kafka import KAFKA_SCHEMA
from microbatch.keygroups import key_group, operator_index
from microbatch.runtime import (
    DeadLetterSink,
    EventTime,
    KafkaSource,
    KeyedProcessFunction,
    Pipeline,
)
from microbatch.runtime.records import StageOne, event_time_ms


class Noop(KeyedProcessFunction):
    def process(self, key, records, ctx) -> None:
        pass


PIPE = Pipeline(
    name="p",
    source=KafkaSource(topics=("t",)),
    key_by="user",
    process=Noop(),
    checkpoints="/tmp/x",
    dead_letters=DeadLetterSink(path="/tmp/dl"),
    event_time=EventTime(field="ts"),
    max_parallelism=16,
    parallelism=3,
)


def kafka_batch(values: list[bytes | None]) -> pa.RecordBatch:
    n = len(values)
    return pa.RecordBatch.from_pydict(
        {
            "key": [None] * n,
            "value": values,
            "topic": ["t"] * n,
            "partition": [1] * n,
            "offset": list(range(100, 100 + n)),
            "timestamp": [0] * n,
            "headers": [[] for _ in range(n)],
        },
        schema=KAFKA_SCHEMA,
    )


def test_each_row_becomes_one_record_or_one_dead_letter_with_its_reason() -> None:
    values = [
        json.dumps({"user": "a", "ts": 5000}).encode(),
        b"{broken",
        None,
        json.dumps({"ts": 1}).encode(),
        json.dumps({"user": 1.5, "ts": 1}).encode(),
        json.dumps({"user": "b"}).encode(),
        json.dumps({"user": "b", "ts": "yesterday"}).encode(),
        json.dumps({"user": "c", "ts": 10}).encode(),
    ]
    out = StageOne(PIPE, parallelism=3, watermark=1000).envelopes(kafka_batch(values))
    rows = [r for r in out.to_pylist() if r["kind"] != "stat"]
    stats = [r for r in out.to_pylist() if r["kind"] == "stat"]
    assert [(s["topic"], s["partition"], s["offset"]) for s in stats] == [("t", 1, 8)]
    assert [r["offset"] for r in rows] == list(range(100, 108))
    kinds = [(r["kind"], r["reason"]) for r in rows]
    assert kinds == [
        ("record", None),
        ("dead_letter", "undecodable"),
        ("dead_letter", "undecodable"),
        ("dead_letter", "missing_key"),
        ("dead_letter", "bad_key"),
        ("dead_letter", "missing_event_time"),
        ("dead_letter", "bad_event_time"),
        ("dead_letter", "late"),
    ]
    first = rows[0]
    assert first["key_group"] == key_group("a", 16)
    assert first["instance"] == operator_index(first["key_group"], 16, 3)
    assert first["event_ts"] == 5000
    assert rows[1]["raw_value"] == b"{broken"


def test_event_times_are_epoch_ms_or_iso_8601() -> None:
    assert event_time_ms(1700000000000) == 1700000000000
    assert event_time_ms("1970-01-01T00:00:01Z") == 1000
    assert event_time_ms("1970-01-01T00:00:02") == 2000
