"""Stage 1 without Spark: every Kafka row becomes exactly one record or dead letter."""

from __future__ import annotations

import json
import re
from typing import Any

import pyarrow as pa
import pytest

from microbatch.kafka import KAFKA_SCHEMA
from microbatch.keygroups import key_group, operator_index
from microbatch.runtime import (
    DeadLetterSink,
    EventTime,
    KafkaSource,
    KeyedProcessFunction,
    Pipeline,
)
from microbatch.runtime.decoding import event_time_ms, fast_json_decoder
from microbatch.runtime.envelope import (
    DeadLetterDetail,
    PartitionStats,
    decode_payload,
    encode_payload,
    partition_stats,
    stage_one_totals,
)
from microbatch.runtime.stage_one import StageOne
from microbatch.state.codec import CodecError, decode_value, encode_value


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
    # Every instance gets the partition's counts: it computes the watermark from them.
    assert [(s["topic"], s["partition"], s["instance"]) for s in stats] == [
        ("t", 1, 0),
        ("t", 1, 1),
        ("t", 1, 2),
    ]
    assert {partition_stats(s["payload"]) for s in stats} == {
        PartitionStats(
            inputs=8,
            records=1,
            dead_letters=7,
            pending=0,
            max_event=5000,
            offset_sums=(100, sum(range(101, 108)), 0),  # which offsets became what
        )
    }
    assert [r["offset"] for r in rows] == list(range(100, 108))
    details = [DeadLetterDetail.from_payload(r["payload"]) for r in rows[1:]]
    kinds = [("record", None)] + [("dead_letter", d.reason) for d in details]
    assert [r["kind"] for r in rows] == [k for k, _ in kinds]
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
    assert details[0].raw_value == b"{broken"
    assert details[0].raw_key is None and details[0].attempts is None
    assert "Expecting property name" in details[0].error


def test_repeated_keys_get_the_key_group_of_their_own_key(monkeypatch) -> None:
    """A task remembers the bytes and key-group of string keys; what it remembers must
    be exactly what each key gives, also once the memory is full and starts over."""
    import microbatch.runtime.stage_one as records
    from microbatch.keygroups import encode_key

    monkeypatch.setattr(records, "_KEYS_REMEMBERED", 3)
    users = ["a", "b", "a", "c", "d", "a", "e", "b", "1", 1, "1"]
    values = [json.dumps({"user": u, "ts": 5000 + i}).encode() for i, u in enumerate(users)]
    out = StageOne(PIPE, parallelism=3, watermark=None).envelopes(kafka_batch(values))

    rows = [r for r in out.to_pylist() if r["kind"] == "record"]
    assert [(r["key"], r["key_group"]) for r in rows] == [
        (encode_key(u), key_group(u, 16)) for u in users
    ]


def test_event_times_are_epoch_ms_or_iso_8601() -> None:
    assert event_time_ms(1700000000000) == 1700000000000
    assert event_time_ms("1970-01-01T00:00:01Z") == 1000
    assert event_time_ms("1970-01-01T00:00:02") == 2000


PLAIN_VALUES = [
    None,
    True,
    -(2**70),
    1.5,
    float("-inf"),
    "user-1 ✓",
    b"\x00raw",
    [1, (2, "three"), {"k": [None]}],
    {"user_id": "u", "page": "/p", "ts": 1_767_225_600_000, 7: (1, 2)},
]


def test_envelope_payloads_decode_to_what_the_state_codec_would_give() -> None:
    import datetime as dt
    from collections import OrderedDict

    others = [
        {"at": dt.datetime(2026, 1, 1, tzinfo=dt.UTC)},  # the codec's tagged form
        OrderedDict(a=1),  # a subclass: comes back a plain dict, as from the codec
        [bytearray(b"x")],
    ]
    for value in PLAIN_VALUES + others:
        payload = encode_payload(value)
        assert decode_payload(payload) == decode_value(encode_value(value)), value
        assert type(decode_payload(payload)) is type(decode_value(encode_value(value)))
    assert encode_payload({"user_id": "u", "ts": 1})[:1] == b"P"  # the fast form
    with pytest.raises(CodecError):
        encode_payload({"s": {1, 2}})  # refused like the codec refuses it


def test_envelope_payloads_keep_equal_sub_values_separate_objects() -> None:
    shared = [1]
    decoded = decode_payload(encode_payload({"a": shared, "b": shared}))
    decoded["a"].append(2)
    assert decoded["b"] == [1]


def test_fast_json_decoder_gives_json_loads_results_and_errors() -> None:
    cases = [
        b'{"a":1}',
        b' {"a": [1, 2.5, null]} ',
        b'\xef\xbb\xbf{"a":1}',
        '{"a":1}'.encode("utf-16"),
        b"NaN",
        b'{"a":1,"a":2}',
        b'{"a":1}x',
        b"{broken",
        b"",
        b"\xff",
    ]
    for raw in cases:
        try:
            expected: Any = json.loads(raw)
        except ValueError as e:
            with pytest.raises(type(e), match=re.escape(str(e))):
                fast_json_decoder(raw)
        else:
            assert repr(fast_json_decoder(raw)) == repr(expected), raw


def test_stage_one_totals_add_up_partitions_split_over_tasks() -> None:
    """Two tasks read halves of t/0 (and one saw only dead letters of t/1): counts add
    up per partition, event times take the max, a partition without records has none."""
    totals = stage_one_totals(
        [
            ("t", 0, PartitionStats(10, 8, 1, 1, 5_000, (36, 9, 11))),
            ("t", 0, PartitionStats(5, 5, 0, 0, 7_000, (60, 0, 0))),
            ("t", 1, PartitionStats(3, 0, 3, 0, None)),
            ("t", 0, PartitionStats(0, 2, 0, 0, 6_000)),  # re-issued pending elements
        ]
    )
    assert totals.to_json() == {
        "inputs": 18,
        "records": 15,
        "dead": 4,
        "pending": 1,
        "max_event": {"t/0": 7_000},
        "per_partition": {
            "t/0": {"inputs": 15, "records": 15, "dead_letters": 1},
            "t/1": {"inputs": 3, "records": 0, "dead_letters": 3},
        },
        "offset_sums": {"t/0": [96, 9, 11], "t/1": [0, 0, 0]},
    }
    assert stage_one_totals([]).max_event == {}


def test_a_dead_letter_after_enrichment_carries_its_source_bytes_from_the_first_lookup() -> None:
    """The index of source bytes is built on the first dead letter's lookup: that lookup
    must find the record too, not fall back to the enriched value."""
    from microbatch.runtime.stage_one import _SourceBytes

    sources = _SourceBytes()
    sources.add(["t", "t"], [0, 1], [7, 9], [b"k7", None], [b"v7", b"v9"])

    assert sources.get(("t", 1, 9)) == (None, b"v9")  # the first lookup builds the index
    assert sources.get(["t", 0, 7]) == (b"k7", b"v7")
    assert sources.get(("t", 0, 8)) is None


def test_an_event_time_beyond_int64_is_a_bad_event_time_not_a_failed_task() -> None:
    values = [json.dumps({"user": "a", "ts": t}).encode() for t in (2**63 - 1, 2**63, -(2**70))]
    out = StageOne(PIPE, parallelism=3, watermark=None).envelopes(kafka_batch(values))

    rows = [r for r in out.to_pylist() if r["kind"] != "stat"]
    assert [r["event_ts"] for r in rows if r["kind"] == "record"] == [2**63 - 1]
    reasons = [DeadLetterDetail.from_payload(r["payload"]).reason for r in rows[1:]]
    assert reasons == ["bad_event_time", "bad_event_time"]
