"""Manifest JSON and format-1 state-file segments (read for the migration; the fixture
writer is test-only): round trips and corruption detection."""

from __future__ import annotations

import io
import json

import pyarrow.feather as feather
import pytest

from microbatch.checkpoint.format1 import decode_segment, plan_reads
from microbatch.checkpoint.manifest import KeyGroupEntry, Manifest
from microbatch.checkpoint.restore import check_restore_parallelism
from microbatch.errors import CheckpointError
from microbatch.keygroups import KeyGroupRange
from microbatch.state import KeyedStateBackend
from tests.format1 import encode_state_file


def _manifest(entries=None, **kw) -> Manifest:
    entries = entries or (KeyGroupEntry("f", 0, 10, 1, 2, 1, 3), None, None, None)
    fields = dict(
        checkpoint_id=3,
        pipeline_fingerprint="fp",
        max_parallelism=len(entries),
        parallelism=2,
        key_groups=tuple(entries),
        full_checkpoint_id=3,
        created_at="2026-01-01T00:00:00Z",
        metadata={"offsets": {"t": [1, 2]}},
    )
    return Manifest(**(fields | kw))


def test_manifest_round_trips_through_json():
    m = _manifest()
    assert Manifest.from_json(m.to_json(), "cp 3") == m


def test_manifest_altered_is_refused():
    body = json.loads(_manifest().to_json())
    body["parallelism"] = 1
    with pytest.raises(CheckpointError, match="cp 3: manifest checksum mismatch"):
        Manifest.from_json(json.dumps(body).encode(), "cp 3")


def test_manifest_truncated_is_refused():
    with pytest.raises(CheckpointError, match="cp 3: manifest is not valid JSON"):
        Manifest.from_json(_manifest().to_json()[:50], "cp 3")


def test_manifest_unknown_version_is_refused_naming_it():
    body = json.loads(_manifest().to_json())
    body["format_version"] = 99
    with pytest.raises(CheckpointError, match="unknown manifest format_version 99"):
        Manifest.from_json(json.dumps(body).encode(), "cp 3")


def test_manifest_validates_entry_count():
    with pytest.raises(CheckpointError, match="1 key-group entries for max_parallelism=4"):
        _manifest(max_parallelism=4, key_groups=(None,))


def _backend_with_state() -> KeyedStateBackend:
    b = KeyedStateBackend(8, KeyGroupRange(0, 7))
    for k in range(200):
        b.for_key(k).value("v").set(k)
        b.for_key(k).list("l").add_all([k, -k])
    return b


def test_state_file_segments_decode_independently_and_file_opens_with_pyarrow():
    b = _backend_with_state()
    groups = {kg: b.export_rows(kg) for kg in b.groups_with_state()}
    data, index = encode_state_file(groups)
    for kg, seg in index.items():
        rows = decode_segment(data[seg.offset : seg.offset + seg.length], seg.crc32, f"kg {kg}")
        assert rows == groups[kg]
        assert seg.rows == len(groups[kg]["key"]) and seg.keys == len(set(groups[kg]["key"]))
    table = feather.read_table(io.BytesIO(data))
    assert table.num_rows == sum(s.rows for s in index.values()) == 600
    assert set(table.column("key_group").to_pylist()) == set(index)


def test_segment_with_flipped_byte_fails_checksum_naming_where():
    b = _backend_with_state()
    data, index = encode_state_file({0: b.export_rows(0)})
    seg = index[0]
    raw = bytearray(data[seg.offset : seg.offset + seg.length])
    raw[len(raw) // 2] ^= 0xFF
    with pytest.raises(CheckpointError, match="checkpoint 7, file f, key-group 0: checksum"):
        decode_segment(bytes(raw), seg.crc32, "checkpoint 7, file f, key-group 0")


def test_plan_reads_coalesces_adjacent_ranges_per_file():
    e = [
        KeyGroupEntry("a", 0, 10, 0, 1, 1, 1),
        KeyGroupEntry("a", 10, 5, 0, 1, 1, 1),
        KeyGroupEntry("b", 100, 5, 0, 1, 1, 1),
        KeyGroupEntry("a", 30, 5, 0, 1, 1, 1),
    ]
    m = _manifest(entries=e, parallelism=2)
    reads = plan_reads(m, range(4))
    assert [(r.file, r.offset, r.length, len(r.groups)) for r in reads] == [
        ("a", 0, 15, 2),
        ("a", 30, 5, 1),
        ("b", 100, 5, 1),
    ]
    gapped = plan_reads(m, range(4), max_gap=15)
    assert [(r.file, r.offset, r.length) for r in gapped] == [("a", 0, 35), ("b", 100, 5)]


def test_restore_above_max_parallelism_is_refused_with_reason():
    with pytest.raises(CheckpointError, match=r"parallelism 5.*max_parallelism=4.*reshard"):
        check_restore_parallelism(_manifest(), 5)
