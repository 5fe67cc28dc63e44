"""Offset ranges and the offset snapshot stored in checkpoint manifests."""

from __future__ import annotations

import itertools
import json

import pytest

from microbatch.errors import SourceError
from microbatch.kafka import OffsetRange, TopicPartition, snapshot_from_json, snapshot_to_json


def test_offset_range_count_is_span():
    assert OffsetRange("t", 0, 10, 25).count == 15
    assert OffsetRange("t", 0, 7, 7).count == 0


@pytest.mark.parametrize(("start", "end", "partition"), [(5, 4, 0), (-1, 3, 0), (0, 1, -2)])
def test_offset_range_invalid_bounds_raise_naming_partition(start, end, partition):
    with pytest.raises(SourceError, match=rf"t\[{partition}\]"):
        OffsetRange("t", partition, start, end)


@pytest.mark.parametrize(
    ("count", "max_records"), [(1, 1), (10, 3), (10, 10), (10, 100), (1001, 7), (99, 1)]
)
def test_split_pieces_are_contiguous_bounded_and_balanced(count, max_records):
    r = OffsetRange("t", 3, 100, 100 + count)
    pieces = r.split(max_records)
    assert pieces[0].start == r.start and pieces[-1].end == r.end
    assert all(a.end == b.start for a, b in itertools.pairwise(pieces))
    assert all(0 < p.count <= max_records for p in pieces)
    assert max(p.count for p in pieces) - min(p.count for p in pieces) <= 1
    assert len(pieces) == -(-count // max_records)
    assert {(p.topic, p.partition) for p in pieces} == {("t", 3)}


def test_split_empty_range_gives_no_pieces():
    assert OffsetRange("t", 0, 5, 5).split(10) == []


def test_split_zero_max_records_raises():
    with pytest.raises(SourceError, match="max_records must be ≥ 1"):
        OffsetRange("t", 0, 0, 5).split(0)


def test_snapshot_json_is_sorted_and_round_trips():
    snap = {
        TopicPartition("zeta", 10): 5,
        TopicPartition("alpha", 2): 0,
        TopicPartition("zeta", 9): 7,
        TopicPartition("alpha", 10): 42,
    }
    data = snapshot_to_json(snap)
    assert data == {"alpha": {"2": 0, "10": 42}, "zeta": {"9": 7, "10": 5}}
    assert list(data) == ["alpha", "zeta"] and list(data["alpha"]) == ["2", "10"]
    back = snapshot_from_json(json.loads(json.dumps(data)))
    assert back == snap
    assert list(back) == sorted(snap)
    assert json.dumps(snapshot_to_json(back)) == json.dumps(data)


def test_snapshot_accepts_plain_tuples():
    assert snapshot_to_json({("t", 1): 3}) == {"t": {"1": 3}}


@pytest.mark.parametrize("bad", [{"t": {"0": -1}}, {"t": {"0": "12"}}, {"t": [1, 2]}])
def test_snapshot_from_json_rejects_bad_values(bad):
    with pytest.raises(SourceError, match="t"):
        snapshot_from_json(bad)


def test_offset_range_json_round_trip():
    r = OffsetRange("t", 2, 3, 9)
    assert OffsetRange.from_json(json.loads(json.dumps(r.to_json()))) == r
