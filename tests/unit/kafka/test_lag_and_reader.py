"""Pure parts of lag and of the reader: lag arithmetic, consumer settings, Arrow layout."""

from __future__ import annotations

from collections import namedtuple

import pyarrow as pa
import pytest

from microbatch.errors import ConfigError, SourceError
from microbatch.kafka import KAFKA_SCHEMA, TopicPartition, consumer_group_name, partition_lag
from microbatch.kafka.offsets import OffsetRange
from microbatch.kafka.reader import _to_batch, build_consumer_config, read_range, split_ranges

TP = TopicPartition
Record = namedtuple("Record", "key value offset timestamp headers")


def test_partition_lag_is_end_minus_committed_never_negative():
    ends = {TP("t", 0): 10, TP("t", 1): 5, TP("t", 2): 7}
    committed = {TP("t", 0): 4, TP("t", 1): 9}
    assert partition_lag(ends, committed) == {TP("t", 0): 6, TP("t", 1): 0, TP("t", 2): 7}


def test_partition_lag_unread_partition_counts_from_beginning():
    assert partition_lag({TP("t", 0): 10}, {}, {TP("t", 0): 8}) == {TP("t", 0): 2}


def test_consumer_group_name_is_derived_from_pipeline():
    assert consumer_group_name("clicks") == "microbatch.clicks"
    with pytest.raises(SourceError):
        consumer_group_name("")


def test_consumer_config_fixes_the_semantic_settings():
    config = build_consumer_config("b:9092", {"fetch_max_bytes": 1024})
    assert config["isolation_level"] == "read_committed"
    assert config["enable_auto_commit"] is False
    assert config["auto_offset_reset"] == "none"
    assert config["check_crcs"] is True
    assert config["fetch_max_bytes"] == 1024
    assert config["bootstrap_servers"] == "b:9092"


@pytest.mark.parametrize(
    "override",
    [
        {"isolation_level": "read_uncommitted"},
        {"check_crcs": False},
        {"auto_offset_reset": "latest"},
    ],
)
def test_consumer_config_rejects_changing_which_records_are_read(override):
    with pytest.raises(ConfigError, match=next(iter(override))):
        build_consumer_config("b:9092", override)


def test_to_batch_builds_kafka_schema_with_headers_and_nulls():
    records = [
        Record(b"k1", b"v1", 5, 1000, [("a", b"x"), ("b", None)]),
        Record(None, b"v2", 7, 1001, []),
        Record(b"k3", None, 8, 1002, [("c", b"")]),
    ]
    batch = _to_batch("topic-1", 3, records)
    assert batch.schema == KAFKA_SCHEMA
    assert batch.to_pylist() == [
        {
            "key": b"k1",
            "value": b"v1",
            "topic": "topic-1",
            "partition": 3,
            "offset": 5,
            "timestamp": 1000,
            "headers": [{"key": "a", "value": b"x"}, {"key": "b", "value": None}],
        },
        {
            "key": None,
            "value": b"v2",
            "topic": "topic-1",
            "partition": 3,
            "offset": 7,
            "timestamp": 1001,
            "headers": [],
        },
        {
            "key": b"k3",
            "value": None,
            "topic": "topic-1",
            "partition": 3,
            "offset": 8,
            "timestamp": 1002,
            "headers": [{"key": "c", "value": b""}],
        },
    ]


def test_kafka_schema_types():
    assert KAFKA_SCHEMA.field("partition").type == pa.int32()
    assert KAFKA_SCHEMA.field("offset").type == pa.int64()
    assert KAFKA_SCHEMA.field("timestamp").type == pa.int64()


def test_split_ranges_drops_empty_sorts_and_splits():
    ranges = [OffsetRange("b", 0, 0, 10), OffsetRange("a", 1, 4, 4), OffsetRange("a", 0, 0, 3)]
    assert split_ranges(ranges, 4) == [
        OffsetRange("a", 0, 0, 3),
        OffsetRange("b", 0, 0, 4),
        OffsetRange("b", 0, 4, 7),
        OffsetRange("b", 0, 7, 10),
    ]
    assert split_ranges(ranges) == [OffsetRange("a", 0, 0, 3), OffsetRange("b", 0, 0, 10)]


def test_read_range_empty_range_yields_nothing_without_connecting():
    assert list(read_range("nowhere.invalid:9092", OffsetRange("t", 0, 5, 5))) == []


def test_to_batch_without_any_headers_gives_empty_lists():
    records = [Record(b"k", b"v", o, 5, []) for o in range(3)]
    batch = _to_batch("t", 0, records)
    assert batch.schema == KAFKA_SCHEMA
    assert batch.column("headers").to_pylist() == [[], [], []]
    assert batch.column("offset").to_pylist() == [0, 1, 2]
