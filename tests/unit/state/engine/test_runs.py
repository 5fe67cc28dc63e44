"""Sorted runs: blocks found by key and by key-group range, merges, corruption."""

from __future__ import annotations

import random
import re

import pyarrow as pa
import pytest

from microbatch.errors import CheckpointError
from microbatch.state.engine import runs
from microbatch.state.engine.runs import composite, decode_block, encode_run, merge


def entries(n: int, kgs: int = 16, seed: int = 0) -> list[runs.Entry]:
    rng = random.Random(seed)
    keys = {
        composite(rng.randrange(kgs), f"user-{rng.randrange(10**9)}".encode()) for _ in range(n)
    }
    return [(k, b"v" + k) for k in sorted(keys)]


def read(data: bytes, index: runs.RunIndex, block: int) -> list[runs.Entry]:
    b = index.blocks[block]
    return decode_block(data[b.offset : b.offset + b.length], b, f"run block {block}")


def test_every_key_is_found_in_the_one_block_the_index_names() -> None:
    rows = entries(5000)
    data, index = encode_run(rows, block_bytes=1024)

    assert len(index.blocks) > 50 and index.rows == 5000
    for key, value in rows[::7]:
        block = index.block_of(key)
        assert block is not None and (key, value) in read(data, index, block)


def test_a_key_between_or_outside_blocks_needs_no_block() -> None:
    _, index = encode_run([(composite(3, b"b"), b"1"), (composite(3, b"d"), b"2")], 1)
    assert len(index.blocks) == 2
    assert index.block_of(composite(3, b"a")) is None  # before the first
    assert index.block_of(composite(3, b"c")) is None  # between the two blocks
    assert index.block_of(composite(4, b"")) is None  # after the last
    probes = [composite(3, b"d"), composite(3, b"a"), composite(3, b"b"), composite(3, b"c")]
    assert index.blocks_of(pa.array(probes)).tolist() == [1, -1, 0, -1]


def test_many_keys_find_the_blocks_one_key_at_a_time_finds() -> None:
    """``blocks_of`` (all keys at once) against ``block_of`` (a binary search per key),
    with keys equal to a block's first or last, between blocks, sharing a prefix with
    a bound, and ending in zero bytes (which a padded fixed-width compare would miss)."""
    rng = random.Random(4)

    def some_key(groups: int, shortest: int) -> bytes:
        size = rng.randrange(shortest, 5)
        return composite(rng.randrange(groups), bytes(rng.randrange(3) for _ in range(size)))

    stored = sorted({some_key(3, 1) for _ in range(400)})
    _, index = encode_run([(k, b"v" * 40) for k in stored], block_bytes=256)
    assert len(index.blocks) > 20
    bounds = [b.first for b in index.blocks] + [b.last for b in index.blocks]
    probes = [*bounds, *(k + b"\x00" for k in bounds), *(k[:-1] for k in bounds if len(k) > 2)]
    probes += [some_key(4, 0) for _ in range(500)]
    rng.shuffle(probes)
    expected = [index.block_of(k) for k in probes]
    assert index.blocks_of(pa.array(probes)).tolist() == [-1 if e is None else e for e in expected]
    assert index.blocks_of(pa.array([], pa.binary())).tolist() == []


def test_a_key_group_range_reads_only_the_blocks_that_overlap_it() -> None:
    rows = entries(4000, kgs=8)
    data, index = encode_run(rows, block_bytes=512)

    picked = index.blocks_in_range(2, 4)
    got = [e for i in picked for e in read(data, index, i)]
    inside = [e for e in got if 2 <= runs.split(e[0])[0] <= 4]

    assert inside == [e for e in rows if 2 <= runs.split(e[0])[0] <= 4]
    assert len(got) - len(inside) < 2 * index.blocks[0].rows  # at most the 2 boundary blocks
    assert list(index.blocks_in_range(9, 12)) == []


def test_the_data_file_opens_with_any_arrow_reader_and_the_index_round_trips() -> None:
    rows = entries(300)
    data, index = encode_run(rows, block_bytes=256)

    table = pa.ipc.open_file(pa.py_buffer(data)).read_all()
    assert table.num_rows == 300 and table.schema.names == ["key_group", "key", "value"]
    assert runs.RunIndex.from_bytes(index.to_bytes(), "run") == index
    assert index.key_groups == (runs.split(rows[0][0])[0], runs.split(rows[-1][0])[0])


def test_a_corrupt_block_is_an_error_naming_it_never_an_empty_state() -> None:
    data, index = encode_run(entries(200), block_bytes=256)
    b = index.blocks[1]
    broken = bytearray(data[b.offset : b.offset + b.length])
    broken[len(broken) // 2] ^= 0xFF

    with pytest.raises(CheckpointError, match=r"run r1 block 1: checksum mismatch"):
        decode_block(bytes(broken), b, "run r1 block 1")
    with pytest.raises(CheckpointError, match="checksum mismatch"):
        decode_block(bytes(broken[:-10]), b, "run r1 block 1")
    with pytest.raises(CheckpointError, match="run index cannot be read"):
        runs.RunIndex.from_bytes(b"not an index", "run r1")


def test_entries_out_of_order_are_refused() -> None:
    with pytest.raises(ValueError, match="out of order"):
        encode_run([(composite(1, b"b"), b""), (composite(1, b"a"), b"")])


@pytest.mark.parametrize("at", [1, 6, 7, 8, 12])  # inside a chunk, and across one
def test_entries_out_of_order_are_refused_wherever_they_are(monkeypatch, at: int) -> None:
    monkeypatch.setattr(runs, "_CHUNK", 7)
    rows = entries(20)
    rows[at] = (rows[at - 1][0], b"again")  # the same key twice is out of order too
    with pytest.raises(ValueError, match=re.escape(f"out of order: {rows[at][0]!r} after")):
        encode_run(iter(rows), block_bytes=1)


def test_a_run_has_the_same_blocks_however_its_entries_are_taken_in_chunks(monkeypatch) -> None:
    """Blocks are cut on bytes, never on where a chunk of entries happened to end; a long
    stream (a merge's) is taken a chunk at a time."""
    rows = [*entries(3000), (composite(16, b"deleted"), None), (composite(16, b"z"), b"v" * 5000)]
    _, whole = encode_run(iter(rows), block_bytes=700)
    monkeypatch.setattr(runs, "_CHUNK", 37)

    plain: list[pa.RecordBatch] = []
    data, index = encode_run(iter(rows), block_bytes=700, plain=plain)

    def spans(i: runs.RunIndex) -> list[tuple[bytes, bytes, int]]:
        return [(b.first, b.last, b.rows) for b in i.blocks]

    assert spans(index) == spans(whole)
    assert [e for b in range(len(index.blocks)) for e in read(data, index, b)] == rows
    assert pa.Table.from_batches(plain).num_rows == len(rows)
    sizes, expected = 0, [0]  # a block ends at the entry that takes it to 700 bytes
    for key, value in rows:
        expected[-1] += 1
        sizes += len(key) + len(value or b"")
        if sizes >= 700:
            sizes = 0
            expected.append(0)
    assert [b.rows for b in index.blocks] == [n for n in expected if n]


def test_a_merge_keeps_the_newest_value_and_drops_deletions_only_at_the_bottom() -> None:
    newest = [(composite(0, b"a"), None), (composite(1, b"c"), b"c2")]
    oldest = [(composite(0, b"a"), b"a1"), (composite(0, b"b"), b"b1"), (composite(1, b"c"), b"c1")]

    assert list(merge([newest, oldest], keep_deletions=True)) == [
        (composite(0, b"a"), None),
        (composite(0, b"b"), b"b1"),
        (composite(1, b"c"), b"c2"),
    ]
    assert list(merge([newest, oldest], keep_deletions=False)) == [
        (composite(0, b"b"), b"b1"),
        (composite(1, b"c"), b"c2"),
    ]


def test_clip_keeps_a_key_group_range() -> None:
    rows = entries(500, kgs=6)
    assert list(runs.clip(rows, 1, 3)) == [e for e in rows if 1 <= runs.split(e[0])[0] <= 3]
