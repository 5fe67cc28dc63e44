"""Point reads across runs: newest wins, only the needed blocks are fetched, a warm cache
fetches nothing, a missing or corrupt run is an error naming it."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from microbatch.errors import CheckpointError, StorageError
from microbatch.state.engine.blockcache import BlockCache, RunRef, lookup, scan
from microbatch.state.engine.runs import composite, encode_run
from microbatch.storage import open_store
from microbatch.storage.counting import CountingStore


def put_run(store, name: str, entries, kgs=(0, 15)) -> RunRef:
    data, index = encode_run(entries, block_bytes=512)
    store.put(f"runs/{name}.arrow", data)
    store.put(f"runs/{name}.index.arrow", index.to_bytes())
    return RunRef(f"runs/{name}.arrow", f"runs/{name}.index.arrow", *kgs)


def key(kg: int, n: int) -> bytes:
    return composite(kg, f"user-{n:07d}".encode())


@pytest.fixture
def store(tmp_path: Path) -> CountingStore:
    return CountingStore(open_store(str(tmp_path / "store")))


@pytest.fixture
def big(store) -> RunRef:
    return put_run(
        store, "big", [(key(kg, n), b"old-%d" % n) for kg in range(16) for n in range(2000)]
    )


def test_the_newest_run_wins_and_a_deletion_reads_as_none(store, big) -> None:
    newer = put_run(store, "newer", [(key(3, 5), b"new"), (key(4, 6), None)])
    found = lookup(
        BlockCache(store), [newer, big], [key(3, 5), key(4, 6), key(5, 7), key(5, 99999)]
    )
    assert found == {key(3, 5): b"new", key(4, 6): None, key(5, 7): b"old-7"}


def test_a_cold_read_of_a_few_keys_fetches_a_small_part_of_the_run(store, big) -> None:
    cache = BlockCache(store)
    total = len(store.inner.get(big.data))
    wanted = [key(kg, n) for kg in range(16) for n in (17, 1017)]  # 32 of 32,000 keys

    found = lookup(cache, [big], wanted)

    assert len(found) == 32
    assert cache.stats.blocks_fetched <= 32
    index = len(store.inner.get(big.index))  # fetched once per run, then cached
    assert cache.stats.bytes_fetched - index < 0.05 * total


def test_a_warm_cache_fetches_nothing_again_even_in_a_new_process(store, big, tmp_path) -> None:
    wanted = [key(kg, 42) for kg in range(16)]
    first = BlockCache(store, tmp_path / "cache")
    lookup(first, [big], wanted)
    store.reset()

    again = BlockCache(store, tmp_path / "cache")  # another task on the same machine
    assert lookup(again, [big], wanted) == lookup(first, [big], wanted)
    assert store.requests.total() == 0 and again.stats.blocks_hit > 0


def test_a_run_serves_only_its_key_group_range(store, big) -> None:
    clipped = RunRef(big.data, big.index, 0, 7)  # the other half belongs to another instance
    assert lookup(BlockCache(store), [clipped], [key(3, 1), key(9, 1)]) == {key(3, 1): b"old-1"}


def test_a_missing_run_is_an_error_naming_it(store, big) -> None:
    gone = RunRef("runs/gone.arrow", "runs/gone.index.arrow", 0, 15)
    with pytest.raises(CheckpointError, match=r"runs/gone.index.arrow cannot be read"):
        lookup(BlockCache(store), [gone, big], [key(1, 1)])


def test_a_corrupt_cached_block_is_an_error_not_an_empty_state(store, big, tmp_path) -> None:
    cache = BlockCache(store, tmp_path / "cache")
    lookup(cache, [big], [key(2, 2)])
    blocks = [p for p in (tmp_path / "cache").rglob("*") if p.is_file() and p.name != "index"]
    for p in blocks:
        p.write_bytes(p.read_bytes()[:-3])

    with pytest.raises(CheckpointError, match=r"runs/big.arrow block \d+ in .* is corrupt"):
        lookup(BlockCache(store, tmp_path / "cache"), [big], [key(2, 2)])


def test_a_corrupt_block_in_the_store_is_an_error_naming_run_and_block(store, big) -> None:
    data = bytearray(store.inner.get(big.data))
    data[len(data) // 2] ^= 0xFF
    store.inner.put(big.data, bytes(data))

    with pytest.raises(CheckpointError, match=r"runs/big.arrow block \d+: checksum mismatch"):
        scan(BlockCache(store), [big], composite(0, b""), composite(16, b""))


def test_a_cache_folder_that_cannot_be_written_fails_naming_it(store, tmp_path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    with pytest.raises(StorageError, match=f"{blocker}/cache is not writable"):
        BlockCache(store, blocker / "cache")


def test_a_range_scan_reads_only_overlapping_blocks_and_the_newest_entries(store, big) -> None:
    newer = put_run(store, "newer", [(key(3, 5), b"new"), (key(3, 6), None)])
    cache = BlockCache(store)

    got = scan(cache, [newer, big], key(3, 0), key(3, 10))

    assert got == [(key(3, n), b"new" if n == 5 else b"old-%d" % n) for n in range(10) if n != 6]
    assert cache.stats.blocks_fetched <= 3  # a block or two of the big run, one of the new


def test_decoded_blocks_stay_in_memory_within_the_bound(store, big) -> None:
    wanted = [key(kg, n) for kg in range(16) for n in range(0, 2000, 97)]
    roomy = BlockCache(store)
    first = lookup(roomy, [big], wanted)
    decoded = roomy.stats.blocks_decoded

    assert lookup(roomy, [big], wanted) == first
    assert roomy.stats.blocks_decoded == decoded  # the second time, nothing to decode

    tight = BlockCache(store, memory_bytes=20_000)  # a block or two
    assert lookup(tight, [big], wanted) == first
    assert lookup(tight, [big], wanted) == first
    assert tight.stats.blocks_decoded > 1.9 * decoded  # evicted, decoded again
    assert tight._decoded_size <= 20_000 or len(tight._decoded) == 1


def test_neighbouring_missing_blocks_are_fetched_with_one_ranged_get(store, big) -> None:
    cache = BlockCache(store)
    index = cache.index(big)
    requests = cache.stats.requests

    fetched = cache.blocks(big, range(10, 40))  # 30 adjacent blocks

    assert sorted(fetched) == list(range(10, 40))
    assert cache.stats.requests - requests == 1
    for n, data in fetched.items():  # each slice is exactly its block (checked by CRC)
        b = index.blocks[n]
        assert data == store.inner.get_range(big.data, b.offset, b.length)


def test_far_apart_blocks_are_fetched_separately(store, big) -> None:
    cache = BlockCache(store)
    index = cache.index(big)
    far = len(index.blocks) - 1
    requests = cache.stats.requests

    cache.blocks(big, [0, far])

    assert cache.stats.requests - requests == 2


def test_a_run_this_process_wrote_is_read_back_without_fetching(store, tmp_path) -> None:
    data, index = encode_run([(key(1, n), b"v%d" % n) for n in range(3000)], block_bytes=512)
    store.put("runs/mine.arrow", data)
    store.put("runs/mine.index.arrow", index.to_bytes())
    ref = RunRef("runs/mine.arrow", "runs/mine.index.arrow", 0, 15, len(data))
    writer = BlockCache(store, tmp_path / "cache")
    writer.keep_run(ref, data, index.to_bytes())

    reader = BlockCache(store, tmp_path / "cache")  # a later batch on the same machine
    found = lookup(reader, [ref], [key(1, 7), key(1, 2999)])

    assert found == {key(1, 7): b"v7", key(1, 2999): b"v2999"}
    assert reader.stats.requests == 0


def test_a_run_kept_from_the_encoders_batches_reads_as_one_decoded(store, tmp_path) -> None:
    entries = [(key(1, n), b"v%d" % n) for n in range(3000)]
    plain: list = []
    data, index = encode_run(entries, block_bytes=512, plain=plain)
    ref = RunRef("runs/mine.arrow", "runs/mine.index.arrow", 0, 15, len(data))
    for name, given in (("from-encoder", plain), ("decoded", None), ("wrong-count", plain[:1])):
        writer = BlockCache(store, tmp_path / name)
        writer.keep_run(ref, data, index.to_bytes(), given)

        reader = BlockCache(store, tmp_path / name)
        keys = [k for k, _ in entries]
        assert lookup(reader, [ref], keys) == dict(entries), name
        assert reader.stats.requests == 0, name


@pytest.mark.parametrize("damage", ["truncated", "bad header"])
def test_a_corrupt_copy_of_a_run_this_process_wrote_is_an_error(store, tmp_path, damage) -> None:
    entries = [(key(1, n), b"v%d" % n) for n in range(3000)]
    data, index = encode_run(entries, block_bytes=512)
    ref = RunRef("runs/mine.arrow", "runs/mine.index.arrow", 0, 15, len(data))
    BlockCache(store, tmp_path / "cache").keep_run(ref, data, index.to_bytes())
    [copy] = [p for p in (tmp_path / "cache").rglob("blocks")]
    body = copy.read_bytes()
    copy.write_bytes(body[:-3] if damage == "truncated" else b"\xff\xff\xff\xff" + body[4:])

    with pytest.raises(CheckpointError, match=r"runs/mine.arrow .*in .* is corrupt"):
        lookup(BlockCache(store, tmp_path / "cache"), [ref], [entries[-1][0]])


def test_many_keys_read_as_the_newest_entry_of_each_across_runs(store, tmp_path) -> None:
    """A batch's bulk lookup (every key at once per block) against a plain dict of the
    runs' entries: present, deleted, absent, between blocks, beyond the last, and the same
    key bytes in another key-group (a block of one key-group keeps keys without theirs)."""
    rng = random.Random(11)
    old = sorted({(key(rng.randrange(4), rng.randrange(3000)), b"o") for _ in range(2500)})
    new = sorted(
        {(k, None if rng.random() < 0.3 else b"n") for k, _ in rng.sample(old, 600)}
        | {(key(1, 5000 + n), b"x") for n in range(50)}
        | {(composite(0, bytes([0, 1])), b"kg0"), (composite(2, bytes([0, 1])), b"kg2")}
    )
    runs = [put_run(store, "new", new), put_run(store, "old", old)]  # newest first
    expected = dict(old) | dict(new)
    wanted = [*expected, *(key(kg, n) for kg in range(6) for n in range(0, 6000, 7))]
    wanted += [composite(1, bytes([0, 1])), composite(3, b""), composite(15, b"\xff" * 9)]
    found = lookup(BlockCache(store, tmp_path / "cache"), runs, wanted)
    assert found == {k: v for k, v in expected.items() if k in set(wanted)}
