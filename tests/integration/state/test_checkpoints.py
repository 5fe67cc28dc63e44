"""Checkpoints end to end on both backends: commit, conflicts, rescale, TTL, timers, GC,
reshard, inspection and corruption — of sorted runs (what microbatch writes) and of
format-1 checkpoints (read for the one-way migration; written by ``tests/format1.py``)."""

from __future__ import annotations

import threading

import pytest

from microbatch.checkpoint import (
    InstanceSnapshot,
    Layout,
    build_manifest,
    checkpoint,
    collect_garbage,
    commit_manifest,
    describe_checkpoint,
    latest_manifest,
    list_checkpoints,
    load_manifest,
    read_key_state,
    reshard,
    restore_instance,
    write_instance_run,
)
from microbatch.checkpoint.restore import empty_backends
from microbatch.errors import CheckpointError
from microbatch.keygroups import encode_key, key_group, key_group_range, operator_index
from microbatch.storage.counting import CountingStore
from tests import format1

MAXP = 16
LAYOUT = Layout("pipe/")
KEYS = range(400)
FORMATS = ("runs", "format1")


def expected(k: int) -> dict:
    return {"count": k, "events": [k, k + 1], "seen": {"x": k}}


def route(backends, key):
    p = len(backends)
    return backends[operator_index(key_group(key, MAXP), MAXP, p)].for_key(key)


def populate(backends, keys=KEYS) -> None:
    for k in keys:
        ctx = route(backends, k)
        ctx.value("count").set(k)
        ctx.list("events").add_all([k, k + 1])
        ctx.map("seen").put("x", k)


def restore_all(store, manifest, p):
    return [restore_instance(store, manifest, p, i)[0] for i in range(p)]


def state_of(backends, key):
    return route(backends, key).backend.describe_key(key)


def write(store, backends, cid, base=None, fmt="runs", metadata=None):
    """Checkpoint ``cid`` of ``backends`` as microbatch writes it, or in format 1."""
    if fmt == "format1":
        return format1.write_checkpoint(store, LAYOUT, backends, cid, base=base, metadata=metadata)
    return checkpoint(
        store, LAYOUT, backends, cid, base=base, pipeline_fingerprint="fp", metadata=metadata
    )


def first_checkpoint(store, p=2, fmt="runs"):
    backends = empty_backends(MAXP, p)
    populate(backends)
    m = write(store, backends, 1, fmt=fmt, metadata={"offsets": {"clicks": {"0": 42}}})
    return backends, m


def run_snapshots(store, backends, cid) -> list[InstanceSnapshot]:
    return [write_instance_run(store, LAYOUT, b, cid, i) for i, b in enumerate(backends)]


def test_commit_writes_one_run_per_instance_plus_manifest(store: CountingStore):
    _, m = first_checkpoint(store)
    assert store.requests["put"] == 4 and store.requests["create"] == 1  # data + index each
    assert list_checkpoints(store, LAYOUT) == [1]
    loaded = latest_manifest(store, LAYOUT)
    assert loaded == m and loaded.metadata == {"offsets": {"clicks": {"0": 42}}}
    assert m.format_version == 2 and m.total_keys == len(KEYS) and len(m.files()) == 4


def test_second_commit_of_same_id_is_refused_as_already_committed(store):
    backends, _ = first_checkpoint(store)
    snaps = run_snapshots(store, backends, 1)
    m = build_manifest(
        1, snaps, max_parallelism=MAXP, pipeline_fingerprint="fp", base=None, full=True
    )
    with pytest.raises(CheckpointError, match="checkpoint 1 is already committed"):
        commit_manifest(store, LAYOUT, m)


def test_an_instance_without_runs_is_refused_since_format_1_is_no_longer_written(store):
    backends = empty_backends(MAXP, 1)
    populate(backends, keys=range(10))
    own = backends[0].key_groups
    state_file_snapshot = InstanceSnapshot(0, own, dict.fromkeys(own), frozenset(own), None, 0)
    with pytest.raises(CheckpointError, match=r"instance\(s\) \[0\] returned no sorted runs"):
        build_manifest(
            1,
            [state_file_snapshot],
            max_parallelism=MAXP,
            pipeline_fingerprint="fp",
            base=None,
            full=True,
        )


def test_racing_commits_of_one_id_exactly_one_wins_and_loser_files_are_gc_garbage(store):
    writers = [empty_backends(MAXP, 2) for _ in range(2)]
    for n, backends in enumerate(writers):
        populate(backends, keys=range(n, 100))
    results: list[object] = [None, None]
    barrier = threading.Barrier(2)

    def run(n):
        snaps = run_snapshots(store, writers[n], 1)
        m = build_manifest(
            1, snaps, max_parallelism=MAXP, pipeline_fingerprint="fp", base=None, full=True
        )
        barrier.wait()
        try:
            commit_manifest(store, LAYOUT, m)
            results[n] = m
        except CheckpointError as e:
            results[n] = e

    threads = [threading.Thread(target=run, args=(n,)) for n in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    winners = [r for r in results if not isinstance(r, Exception)]
    losers = [r for r in results if isinstance(r, Exception)]
    assert len(winners) == 1 and len(losers) == 1
    assert "already committed" in str(losers[0])
    assert load_manifest(store, LAYOUT, 1) == winners[0]
    assert len(store.list(LAYOUT.state)) == 8
    gc = collect_garbage(store, LAYOUT, keep_last=1)
    assert set(store.list(LAYOUT.state)) == winners[0].files()
    assert len(gc.deleted_files) == 4


def test_restore_format_1_from_p2_at_p3_gives_every_key_its_state_reading_only_own_bytes(
    store,
):
    _, m = first_checkpoint(store, p=2, fmt="format1")
    total_read = 0
    for i in range(3):
        store.reset()
        backend, stats = restore_instance(store, m, 3, i)
        own = key_group_range(MAXP, 3, i)
        own_bytes = sum(m.key_groups[kg].length for kg in own if m.key_groups[kg])
        assert stats.bytes_read == store.bytes_read == own_bytes
        assert store.requests["get_range"] == stats.requests <= 2  # ≤ one GET per file
        total_read += stats.bytes_read
        for k in KEYS:
            if key_group(k, MAXP) in own:
                assert backend.describe_key(k) == expected(k)
        assert backend.keys() == {encode_key(k) for k in KEYS if key_group(k, MAXP) in own}
    assert total_read == m.total_bytes


def test_restore_runs_from_p2_at_p3_gives_every_key_its_state(store):
    _, m = first_checkpoint(store, p=2)
    for i in range(3):
        backend, _ = restore_instance(store, m, 3, i)
        own = key_group_range(MAXP, 3, i)
        for k in KEYS:
            if key_group(k, MAXP) in own:
                assert backend.describe_key(k) == expected(k)
        assert backend.keys() == {encode_key(k) for k in KEYS if key_group(k, MAXP) in own}


@pytest.mark.parametrize("fmt", FORMATS)
def test_rescale_down_and_checkpoint_again_keeps_all_state(store, fmt):
    _, m1 = first_checkpoint(store, p=2, fmt=fmt)
    one = restore_all(store, m1, 1)
    route(one, 3).list("events").add(99)
    m2 = checkpoint(store, LAYOUT, one, 2, base=m1, pipeline_fingerprint="fp")
    four = restore_all(store, m2, 4)
    assert state_of(four, 3)["events"] == [3, 4, 99]
    assert all(state_of(four, k) == expected(k) for k in KEYS if k != 3)


@pytest.mark.parametrize("fmt", FORMATS)
def test_ttl_expired_state_is_dropped_at_checkpoint_and_not_restored(store, fmt):
    now = [1000.0]
    backends = empty_backends(MAXP, 2, clock=lambda: now[0])
    route(backends, "short").value("v", ttl=5).set(1)
    route(backends, "long").value("v", ttl=500).set(2)
    m1 = write(store, backends, 1, fmt=fmt)
    now[0] += 10
    m2 = write(store, backends, 2, base=m1, fmt=fmt)
    assert m2.total_keys == 1
    restored = [restore_instance(store, m2, 2, i, clock=lambda: now[0])[0] for i in range(2)]
    assert state_of(restored, "short") == {}
    assert state_of(restored, "long") == {"v": 2}


@pytest.mark.parametrize("fmt", FORMATS)
def test_timers_survive_a_rescale_and_fire_in_order(store, fmt):
    backends = empty_backends(MAXP, 2)
    for k, ts in [("a", 30), ("b", 10), ("c", 20), ("d", 99)]:
        route(backends, k).register_timer(ts)
    m = write(store, backends, 1, fmt=fmt)
    restored = restore_all(store, m, 3)
    fired = sorted(t for b in restored for t in b.advance_watermark(50))
    assert [t.timestamp for t in fired] == [10, 20, 30]
    m2 = checkpoint(store, LAYOUT, restored, 2, base=m, pipeline_fingerprint="fp")
    again = restore_all(store, m2, 1)
    assert [t.timestamp for t in again[0].advance_watermark(1000)] == [99]


def test_gc_keeps_last_n_and_never_deletes_referenced_format_1_files(store):
    backends, m = first_checkpoint(store, fmt="format1")
    first_files = m.files()
    for cid in range(2, 6):
        route(backends, 0).value("count").set(cid)  # one key-group changes each time
        m = write(store, backends, cid, base=m, fmt="format1")
    store.put(LAYOUT.state_key(3, 0, "deadbeef"), b"uncommitted attempt")
    store.put(LAYOUT.state_key(9, 0, "cafe"), b"in flight")
    result = collect_garbage(store, LAYOUT, keep_last=2)
    assert result.retained == (4, 5) and result.deleted_manifests == (1, 2, 3)
    remaining = set(store.list(LAYOUT.state))
    for cid in (4, 5):
        assert load_manifest(store, LAYOUT, cid).files() <= remaining
    assert first_files & remaining, "old files still referenced by incremental entries stay"
    assert LAYOUT.state_key(9, 0, "cafe") in remaining
    assert LAYOUT.state_key(3, 0, "deadbeef") not in remaining
    restored = restore_all(store, load_manifest(store, LAYOUT, 4), 2)
    assert state_of(restored, 1) == expected(1)


@pytest.mark.parametrize("fmt", FORMATS)
def test_reshard_changes_max_parallelism_and_keeps_every_key(store, fmt):
    first_checkpoint(store, fmt=fmt)
    result = reshard(store, LAYOUT, 1, 64)
    assert result.keys == len(KEYS) and result.target.max_parallelism == 64
    target = latest_manifest(store, LAYOUT)
    assert target.checkpoint_id == 2 and target.metadata["offsets"] == {"clicks": {"0": 42}}
    assert target.format_version == 2
    for k in (0, 5, 399):
        assert read_key_state(store, LAYOUT, k) == expected(k)
    b, _ = restore_instance(store, target, 5, operator_index(key_group(9, 64), 64, 5))
    assert b.describe_key(9) == expected(9)


def test_inspection_describes_a_format_1_checkpoint_and_reads_one_key_with_one_range(store):
    _, m = first_checkpoint(store, fmt="format1")
    desc = describe_checkpoint(store, LAYOUT, 1)
    assert desc["total_keys"] == len(KEYS) and desc["parallelism"] == 2
    assert sum(i["bytes"] for i in desc["instances"]) == m.total_bytes
    assert len(desc["key_groups"]) == MAXP
    store.reset()
    assert read_key_state(store, LAYOUT, 123, 1) == expected(123)
    assert store.requests["get_range"] == 1


def test_inspection_describes_runs_and_reads_one_key(store):
    _, m = first_checkpoint(store)
    desc = describe_checkpoint(store, LAYOUT, 1)
    assert desc["total_keys"] == len(KEYS) and desc["parallelism"] == 2
    assert sum(i["bytes"] for i in desc["instances"]) == m.total_bytes
    assert sum(g["keys"] for g in desc["key_groups"]) == len(KEYS)
    assert read_key_state(store, LAYOUT, 123, 1) == expected(123)


def _flip(store, key, at):
    data = bytearray(store.get(key))
    data[at] ^= 0xFF
    store.put(key, bytes(data))


def test_corrupt_state_file_error_names_checkpoint_file_and_key_group(store):
    _, m = first_checkpoint(store, fmt="format1")
    kg = next(g for g in key_group_range(MAXP, 2, 0) if m.key_groups[g])
    entry = m.key_groups[kg]
    _flip(store, entry.file, entry.offset + entry.length // 2)
    with pytest.raises(
        CheckpointError, match=rf"checkpoint 1, file .*{entry.file}, key-group {kg}"
    ):
        restore_instance(store, m, 2, 0)


def test_truncated_state_file_is_an_error(store):
    _, m = first_checkpoint(store, fmt="format1")
    file = m.key_groups[key_group_range(MAXP, 2, 1).end].file
    store.put(file, store.get(file)[:100])
    with pytest.raises(CheckpointError, match="truncated"):
        restore_instance(store, m, 2, 1)


def test_missing_state_file_is_an_error(store):
    _, m = first_checkpoint(store, fmt="format1")
    file = m.key_groups[key_group_range(MAXP, 2, 0).start].file
    store.delete(file)
    with pytest.raises(CheckpointError, match="state file is missing"):
        restore_instance(store, m, 2, 0)


def test_corrupt_or_missing_manifest_is_an_error(store):
    first_checkpoint(store)
    _flip(store, LAYOUT.manifest_key(1), 30)
    with pytest.raises(CheckpointError, match=r"checkpoint 1 .*manifest"):
        load_manifest(store, LAYOUT, 1)
    with pytest.raises(CheckpointError, match=r"checkpoint 7 .*no such committed checkpoint"):
        load_manifest(store, LAYOUT, 7)


def test_restore_above_max_parallelism_is_refused(store):
    _, m = first_checkpoint(store)
    with pytest.raises(CheckpointError, match="parallelism 17"):
        restore_instance(store, m, 17, 0)
