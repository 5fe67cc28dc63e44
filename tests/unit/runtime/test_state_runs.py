"""Keyed state in sorted runs through the whole batch protocol (stand-in broker and
executor from test_protocol): a batch loads only the keys it touches, writes one run per
instance, merges runs by size tiers, rescales between any two batches, migrates a
checkpoint of the older format, and GC keeps exactly what retained checkpoints name."""

from __future__ import annotations

import collections
import dataclasses
import re

import pytest

from microbatch.checkpoint import (
    Layout,
    describe_checkpoint,
    format_description,
    latest_manifest,
    list_checkpoints,
    load_manifest,
    read_key_state,
    restore_instance,
)
from microbatch.errors import CheckpointError, StorageError
from microbatch.keygroups import decode_key
from microbatch.runtime import BatchOptions, KafkaSource, ParquetSink, Pipeline
from microbatch.storage import open_store
from tests import format1
from tests.unit.runtime.test_protocol import CountPerUser, Log, runner, totals

USERS = [f"user-{i:03d}" for i in range(60)]


@pytest.fixture
def pipeline(tmp_path) -> Pipeline:
    return Pipeline(
        name="counts",
        source=KafkaSource(topics=("clicks",)),
        key_by="user",
        process=CountPerUser(),
        sinks=[ParquetSink("totals", str(tmp_path / "totals"))],
        checkpoints=str(tmp_path / "checkpoints"),
        max_parallelism=8,
        parallelism=2,
    )


def state_of(pipeline) -> dict[str, int]:
    """Every key's ``total`` in the newest checkpoint, read whole (a tool's view)."""
    store = open_store(pipeline.checkpoints)
    manifest = latest_manifest(store, Layout())
    out = {}
    for i in range(manifest.parallelism):
        backend, _ = restore_instance(store, manifest, manifest.parallelism, i)
        for kb in backend.keys(backend.groups_with_state()):
            key = decode_key(kb)
            out[key] = backend.for_key(key).value("total").get()
    return out


def produce_round(log: Log, round_: int) -> list[str]:
    users = USERS[round_ * 7 % 50 : round_ * 7 % 50 + 10]
    log.produce(round_ % 2, *users)
    return users


def test_batches_load_only_their_keys_and_write_one_run_per_instance(pipeline) -> None:
    log = Log(partitions=2)
    log.produce(0, *USERS[:40])
    runner(pipeline, log).run()
    log.produce(1, "user-001", "user-002")

    result = runner(pipeline, log).run()

    manifest = latest_manifest(open_store(pipeline.checkpoints), Layout())
    assert manifest.format_version == 2 and manifest.runs is not None
    assert manifest.total_keys == 40
    new = [r for r in manifest.runs if Layout().state_id(r.data) == result.batch_id]
    assert 1 <= len(new) <= 2  # one run per instance that changed a key
    stats = BatchRecordStats.of(manifest)
    assert stats.keys_loaded == 2  # not the 40 keys of the state
    assert state_of(pipeline)["user-001"] == 2


class BatchRecordStats:
    """The per-instance counters a batch record keeps, summed."""

    def __init__(self, counters: collections.Counter) -> None:
        self.keys_loaded = counters["keys_loaded"]

    @classmethod
    def of(cls, manifest) -> BatchRecordStats:
        from microbatch.runtime.records import BatchRecord

        record = BatchRecord.of(manifest)
        assert record.stats is not None
        counters: collections.Counter[str] = collections.Counter()
        for instance in record.stats.instances:
            counters.update(instance.counters)
        return cls(counters)


def test_state_survives_rescales_and_merges_and_equals_a_plain_count(pipeline) -> None:
    log = Log(partitions=2)
    expected: collections.Counter[str] = collections.Counter()
    for round_, parallelism in enumerate([2, 2, 3, 3, 3, 1, 1, 4, 4, 2, 2, 2, 2, 3]):
        expected.update(produce_round(log, round_))
        runner(pipeline, log).run(BatchOptions(parallelism=parallelism))

    assert state_of(pipeline) == dict(expected)
    store = open_store(pipeline.checkpoints)
    manifest = latest_manifest(store, Layout())
    assert manifest.total_keys == len(expected)
    per_kg = collections.Counter()
    for kg in range(manifest.max_parallelism):
        per_kg[kg] = sum(1 for r in manifest.runs if r.kg_first <= kg <= r.kg_last)
    assert max(per_kg.values()) <= 4, "size tiers should have merged the runs of 14 batches"
    last = {u: n for u, n in totals(pipeline)}  # the newest emitted total per user
    assert {u: max(n for v, n in totals(pipeline) if v == u) for u in last} == dict(expected)


def test_a_key_reads_back_with_the_inspection_tool(pipeline) -> None:
    log = Log(partitions=2)
    log.produce(0, "ann", "ann", "bob")
    runner(pipeline, log).run()

    state = read_key_state(open_store(pipeline.checkpoints), Layout(), "ann")

    assert state == {"total": 2}


def test_gc_keeps_exactly_the_runs_retained_checkpoints_name(pipeline) -> None:
    pipeline = dataclasses.replace(pipeline, retain_checkpoints=2)
    log = Log(partitions=2)
    for round_ in range(9):
        produce_round(log, round_)
        runner(pipeline, log).run()

    store = open_store(pipeline.checkpoints)
    layout = Layout()
    ids = list_checkpoints(store, layout)
    named = set().union(*(load_manifest(store, layout, i).files() for i in ids))
    state_objects = {k for k in store.list(layout.state) if layout.state_id(k) is not None}
    assert len(ids) == 2
    assert state_objects == named


def test_a_checkpoint_of_the_older_format_is_migrated_by_the_next_batch(pipeline) -> None:
    log = Log(partitions=2)
    log.produce(0, "ann", "bob", "ann")
    runner(pipeline, log).run()
    store, layout = open_store(pipeline.checkpoints), Layout()
    runs_manifest = latest_manifest(store, layout)
    # Rewrite checkpoint 0 as format 1 (one state file per instance), as an older
    # microbatch wrote it.
    backends = [
        restore_instance(store, runs_manifest, runs_manifest.parallelism, i)[0]
        for i in range(runs_manifest.parallelism)
    ]
    store.delete(layout.manifest_key(0))
    format1.write_checkpoint(
        store,
        layout,
        backends,
        0,
        pipeline_fingerprint=runs_manifest.pipeline_fingerprint,
        metadata=runs_manifest.metadata,
    )
    assert load_manifest(store, layout, 0).format_version == 1

    log.produce(1, "ann", "cid")
    runner(pipeline, log).run(BatchOptions(parallelism=3))

    migrated = latest_manifest(store, layout)
    assert migrated.format_version == 2 and migrated.total_keys == 3
    assert state_of(pipeline) == {"ann": 3, "bob": 1, "cid": 1}


def fresh_cache_runner(pipeline, log: Log, tmp_path) -> object:
    """A runner whose executors start with an empty block cache (a new machine)."""
    run = runner(pipeline, log)
    folder = tmp_path / f"cache-{len(list(tmp_path.iterdir()))}"
    run.settings = dataclasses.replace(run.settings, state_cache_dir=str(folder))
    return run


def test_a_missing_run_fails_the_batch_naming_the_run_never_an_empty_state(
    pipeline, tmp_path
) -> None:
    log = Log(partitions=2)
    log.produce(0, "ann", "bob")
    runner(pipeline, log).run()
    store = open_store(pipeline.checkpoints)
    lost = latest_manifest(store, Layout()).runs[0]
    store.delete(lost.data)
    log.produce(0, "ann", "bob")

    with pytest.raises(CheckpointError, match=re.escape(lost.data)):
        fresh_cache_runner(pipeline, log, tmp_path).run()


def test_a_corrupt_block_fails_the_batch_naming_run_and_block(pipeline, tmp_path) -> None:
    log = Log(partitions=2)
    log.produce(0, "ann", "bob")
    runner(pipeline, log).run()
    store = open_store(pipeline.checkpoints)
    for ref in latest_manifest(store, Layout()).runs:
        data = bytearray(store.get(ref.data))
        data[len(data) // 3] ^= 0xFF  # one flipped byte inside the first block
        store.put(ref.data, bytes(data))
    log.produce(0, "ann", "bob")

    with pytest.raises(CheckpointError, match=r"block 0: checksum mismatch"):
        fresh_cache_runner(pipeline, log, tmp_path).run()


def test_an_unwritable_cache_folder_fails_naming_the_folder(pipeline, tmp_path) -> None:
    log = Log(partitions=2)
    log.produce(0, "ann")
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a file where the cache folder should be")
    run = runner(pipeline, log)
    run.settings = dataclasses.replace(run.settings, state_cache_dir=str(blocker / "cache"))

    with pytest.raises(StorageError, match=re.escape(str(blocker / "cache"))):
        run.run()


def test_describe_checkpoint_counts_keys_and_runs_per_instance(pipeline) -> None:
    log = Log(partitions=2)
    log.produce(0, *USERS[:30])
    runner(pipeline, log).run()

    desc = describe_checkpoint(open_store(pipeline.checkpoints), Layout(), 0)

    assert desc["total_keys"] == 30
    assert sum(i["keys"] for i in desc["instances"]) == 30
    assert all(i["runs"] == 1 and i["bytes"] > 0 for i in desc["instances"])
    assert desc["written_now_bytes"] == desc["total_bytes"] > 0
    assert "30 keys" in format_description(desc)
