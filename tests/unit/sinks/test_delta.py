"""The Delta sink on local tables: one commit per batch with its app transaction, reruns
and zombies commit nothing twice, foreign commits are retried, backfills replace in one
version, and schema changes evolve or fail before anything is committed."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from deltalake import DeltaTable, write_deltalake

from microbatch.checkpoint import Layout
from microbatch.errors import ConfigError, SinkError
from microbatch.settings import Settings
from microbatch.sinks import DeltaSink, PublishContext, StageContext, read_delta_sink
from microbatch.sinks.delta import DeltaTarget
from microbatch.sinks.replacement import after_batch
from microbatch.storage import open_store

SCHEMA = pa.schema([("user", pa.string()), ("n", pa.int64())])
SETTINGS = Settings.from_env()


def target(path: Path, schema: pa.Schema = SCHEMA, **kw: Any) -> DeltaTarget:
    return DeltaTarget(DeltaSink("out", str(path), schema, **kw), "pipe", SETTINGS)


def batch(t: DeltaTarget, batch_id: int, rows: list[dict], **kw: Any) -> bool:
    table = pa.Table.from_pylist(rows, schema=t.sink.schema)
    files = t.write_files(table, batch_id, 0, f"a{batch_id}")
    return t.publish(batch_id, files, **kw)


def rows(path: Path) -> list[tuple]:
    return sorted(tuple(r.values()) for r in read_delta_sink(str(path)).to_pylist())


def data_commits(path: Path) -> list[dict]:
    """(version, txn, adds, removes) of each commit after the table's creation (version 0,
    protocol and metaData only), oldest first, from the log itself."""
    out = []
    for entry in sorted((path / "_delta_log").glob("*.json")):
        actions = [json.loads(line) for line in entry.read_text().splitlines()]
        if any("protocol" in a for a in actions):
            assert entry.stem == f"{0:020d}" and not any("add" in a for a in actions)
            continue
        out.append(
            {
                "version": int(entry.stem),
                "txn": [a["txn"]["version"] for a in actions if "txn" in a],
                "adds": sum("add" in a for a in actions),
                "removes": sum("remove" in a for a in actions),
            }
        )
    return out


def test_a_batch_commits_once_with_its_app_transaction(tmp_path: Path) -> None:
    t = target(tmp_path)
    assert batch(t, 0, [{"user": "a", "n": 1}])
    assert not batch(t, 0, [{"user": "a", "n": 1}])  # the rerun after a crash: nothing
    assert batch(t, 1, [{"user": "b", "n": 2}])
    assert rows(tmp_path) == [("a", 1), ("b", 2)]
    assert [(c["txn"], c["adds"]) for c in data_commits(tmp_path)] == [([0], 1), ([1], 1)]
    assert t.last_published() == 1


def test_two_publishes_of_one_batch_from_one_snapshot_commit_once(tmp_path: Path) -> None:
    t = target(tmp_path)
    batch(t, 0, [{"user": "a", "n": 1}])
    files = t.write_files(pa.Table.from_pylist([{"user": "z", "n": 9}], schema=SCHEMA), 1, 0, "z")
    first, zombie = t.load(), t.load()  # both read the table before either commits
    assert t.publish(1, files, snapshot=first)
    assert not t.publish(1, files, snapshot=zombie)  # conflict, re-read: already there
    assert rows(tmp_path) == [("a", 1), ("z", 9)]
    assert [c["txn"] for c in data_commits(tmp_path)] == [[0], [1]]


def test_a_foreign_commit_after_our_snapshot_is_retried_on_the_new_version(
    tmp_path: Path,
) -> None:
    t = target(tmp_path)
    batch(t, 0, [{"user": "a", "n": 1}])
    batch(t, 1, [{"user": "b", "n": 2}])
    stale = t.load()
    write_deltalake(str(tmp_path), pa.Table.from_pylist([{"user": "f", "n": 7}], schema=SCHEMA),
                    mode="append")  # fmt: skip
    # Batch 2 recomputes batch 0 (a backfill): adds and a remove on top of a stale snapshot.
    files = t.write_files(pa.Table.from_pylist([{"user": "a", "n": 5}], schema=SCHEMA), 2, 0, "r")
    assert t.publish(2, files, supersedes=[0], snapshot=stale)
    assert rows(tmp_path) == [("a", 5), ("b", 2), ("f", 7)]
    commits = data_commits(tmp_path)
    assert [c["version"] for c in commits] == [1, 2, 3, 4]
    assert (commits[3]["txn"], commits[3]["adds"], commits[3]["removes"]) == ([2], 1, 1)


def test_a_backfill_replaces_each_batch_in_the_same_version(tmp_path: Path) -> None:
    t = target(tmp_path)
    for b in range(3):
        batch(t, b, [{"user": f"u{b}", "n": b}], end_offsets={"t:0": 10 * (b + 1)})
    assert t.publish_rewind(3, [1, 2])
    assert not t.publish_rewind(3, [1, 2])  # a rerun
    awaiting = t.sink.awaiting_replacement(SETTINGS, [])
    assert awaiting == {"1": {"t:0": 20}, "2": {"t:0": 30}}
    for b, ends in ((4, {"t:0": 20}), (5, {"t:0": 30})):
        supersedes, awaiting = after_batch(awaiting, ends)
        batch(t, b, [{"user": f"u{b - 3}", "n": 10 * b}], end_offsets=ends, supersedes=supersedes)
    assert rows(tmp_path) == [("u0", 0), ("u1", 40), ("u2", 50)]
    last = data_commits(tmp_path)[-2:]
    assert [(c["txn"], c["adds"], c["removes"]) for c in last] == [([4], 1, 1), ([5], 1, 1)]
    assert t.awaiting_replacement([]) == {}


def test_a_new_nullable_column_is_added_and_incompatible_schemas_fail_naming_the_column(
    tmp_path: Path,
) -> None:
    batch(target(tmp_path), 0, [{"user": "a", "n": 1}])
    wider = pa.schema([*SCHEMA, pa.field("extra", pa.float64())])
    t = target(tmp_path, wider)
    assert [f.name for f in t.check_schema().add] == ["extra"]
    batch(t, 1, [{"user": "b", "n": 2, "extra": 0.5}])
    assert rows(tmp_path) == [("a", 1, None), ("b", 2, 0.5)]
    assert DeltaTable(str(tmp_path)).schema().fields[-1].name == "extra"

    retyped = pa.schema([("user", pa.string()), ("n", pa.int32()), ("extra", pa.float64())])
    with pytest.raises(SinkError, match=r"pipeline 'pipe' sink 'out'.*column 'n' has type"):
        target(tmp_path, retyped).check_schema()
    strict = pa.schema([*wider, pa.field("id", pa.int64(), nullable=False)])
    with pytest.raises(SinkError, match="new column 'id' is NOT NULL"):
        target(tmp_path, strict).check_schema()
    with pytest.raises(SinkError, match=r"partitioned by \[\] but the sink says"):
        target(tmp_path, wider, partition_by=("user",)).check_schema()


def test_a_dropped_non_null_column_fails_before_any_commit(tmp_path: Path) -> None:
    strict = pa.schema([pa.field("user", pa.string(), nullable=False), ("n", pa.int64())])
    batch(target(tmp_path, strict), 0, [{"user": "a", "n": 1}])
    versions = len(data_commits(tmp_path))
    t = target(tmp_path, pa.schema([("n", pa.int64())]))
    with pytest.raises(SinkError, match="column 'user' is NOT NULL in the table but missing"):
        batch(t, 1, [{"n": 2}])
    assert len(data_commits(tmp_path)) == versions


def test_stage_writes_the_same_bytes_per_attempt_and_publish_reads_the_index(
    tmp_path: Path,
) -> None:
    sink = DeltaSink("out", str(tmp_path / "t"), SCHEMA, partition_by="user")
    store = open_store(str(tmp_path / "ck"))
    records = [{"user": "a", "n": 1}, {"user": "b", "n": 2}, {"user": None, "n": 3}]
    staged = [
        sink.stage(StageContext("pipe", 0, 0, SETTINGS, store, Layout(), attempt), records)
        for attempt in ("one", "two")
    ]
    assert all(s is not None and s.rows == 3 for s in staged)
    files = sorted(p for p in (tmp_path / "t").rglob("*.parquet"))
    by_attempt: dict[str, list[bytes]] = {}
    for p in files:
        by_attempt.setdefault(p.stem.rsplit("-", 1)[1], []).append(p.read_bytes())
    assert by_attempt["one"] == by_attempt["two"]  # same rows, same bytes, own names
    assert {p.parent.name for p in files} == {"user=a", "user=b", "user=__HIVE_DEFAULT_PARTITION__"}

    ctx = PublishContext("pipe", 0, SETTINGS, store, Layout(), (staged[1],), {"t:0": 3})  # type: ignore[arg-type]
    sink.publish(ctx)
    sink.publish(ctx)
    assert sorted(read_delta_sink(str(tmp_path / "t")).to_pylist(), key=lambda r: r["n"]) == [
        {"n": 1, "user": "a"}, {"n": 2, "user": "b"}, {"n": 3, "user": None}]  # fmt: skip
    assert sink.last_published(SETTINGS, "pipe") == 0
    assert sink.stage(StageContext("pipe", 1, 0, SETTINGS, store, Layout(), "x"), []) is None


def test_a_location_with_other_files_is_refused_with_what_to_do(tmp_path: Path) -> None:
    (tmp_path / "old.parquet").write_bytes(b"PAR1")
    with pytest.raises(SinkError, match=r"holds files but no Delta table.*convert_to_deltalake"):
        target(tmp_path).check_schema()


def test_bad_definitions_are_config_errors() -> None:
    with pytest.raises(ConfigError, match=r"schema must be a pyarrow\.Schema"):
        DeltaSink("out", "/tmp/x", None)
    with pytest.raises(ConfigError, match="partition column 'day' is not in the schema"):
        DeltaSink("out", "/tmp/x", SCHEMA, partition_by=("day",))
    with pytest.raises(ConfigError, match="table_uri is empty"):
        DeltaSink("out", "", SCHEMA)


@pytest.mark.parametrize("batch_id", [0, 1])
def test_racing_publishes_of_one_batch_commit_it_once(tmp_path: Path, batch_id: int) -> None:
    """Two attempts of one batch, each with its own files, publish at the same moment —
    batch 0 also racing to create the table: one data version, one attempt's files, one
    txn, whichever wins."""
    import threading

    t = target(tmp_path)
    if batch_id:
        batch(t, 0, [{"user": "z", "n": 0}])
    table = pa.Table.from_pylist([{"user": "a", "n": 1}], schema=SCHEMA)
    files = {name: t.write_files(table, batch_id, 0, name) for name in ("one", "two")}
    results: dict[str, bool] = {}
    start = threading.Barrier(2)

    def publish(name: str) -> None:
        start.wait()
        results[name] = target(tmp_path).publish(batch_id, files[name])

    threads = [threading.Thread(target=publish, args=(n,)) for n in files]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert sorted(results.values()) == [False, True]
    assert rows(tmp_path) == [("a", 1), ("z", 0)][: 1 + batch_id]
    assert [(c["txn"], c["adds"]) for c in data_commits(tmp_path)][batch_id:] == [([batch_id], 1)]


def test_optimize_merges_each_batchs_files_without_changing_rows_or_replacement(
    tmp_path: Path,
) -> None:
    t = target(tmp_path)
    for b in range(2):
        files = [  # two operator instances per batch
            f
            for instance in range(2)
            for f in t.write_files(
                pa.Table.from_pylist([{"user": f"u{instance}", "n": b}], schema=SCHEMA),
                b, instance, f"a{b}",
            )
        ]  # fmt: skip
        t.publish(b, files, end_offsets={"t:0": 10 * (b + 1)})
    before = rows(tmp_path)
    assert t.optimize(dry_run=True)["files_before"] == 4
    done = t.optimize()
    assert (done["batches"], done["files_before"], done["files_after"]) == (2, 4, 2)
    assert rows(tmp_path) == before
    assert t.optimize()["files_after"] == 0  # nothing left to merge
    entry = tmp_path / "_delta_log" / f"{done['version']:020d}.json"
    actions = [json.loads(line) for line in entry.read_text().splitlines()]
    changes = [a[k] for a in actions for k in ("add", "remove") if k in a]
    assert len(changes) == 6 and not any(c["dataChange"] for c in changes)
    assert t.last_published() == 1  # no txn moved

    # A backfill still replaces batch 0, now one compacted file.
    t.publish_rewind(2, [0, 1])
    assert t.awaiting_replacement() == {"0": {"t:0": 10}, "1": {"t:0": 20}}
    batch(t, 3, [{"user": "u0", "n": 99}], end_offsets={"t:0": 10}, supersedes=[0])
    assert rows(tmp_path) == [("u0", 1), ("u0", 99), ("u1", 1)]


def test_vacuum_deletes_only_old_unreferenced_files(tmp_path: Path) -> None:
    import os
    import time

    t = target(tmp_path)
    batch(t, 0, [{"user": "a", "n": 1}])
    table = pa.Table.from_pylist([{"user": "zombie", "n": 0}], schema=SCHEMA)
    orphan = tmp_path / t.write_files(table, 1, 0, "crashed")[0]["path"]  # never committed
    fresh = tmp_path / t.write_files(table, 1, 0, "running")[0]["path"]  # about to commit
    two_hours_ago = time.time() - 7200
    os.utime(orphan, (two_hours_ago, two_hours_ago))
    with pytest.raises(ConfigError, match="below 1 h"):
        t.vacuum(retention_hours=0)
    assert [Path(p).name for p in t.vacuum(retention_hours=1, dry_run=True)] == [orphan.name]
    t.vacuum(retention_hours=1)
    assert not orphan.exists() and fresh.exists()
    assert rows(tmp_path) == [("a", 1)]


def test_orphans_of_attempts_that_lost_the_commit_are_collected(tmp_path: Path) -> None:
    t = target(tmp_path, partition_by=("user",))
    table = pa.Table.from_pylist([{"user": "a", "n": 1}, {"user": "b", "n": 2}], schema=SCHEMA)
    lost = t.write_files(table, 0, 0, "lost")  # a zombie's, never committed
    t.publish(0, t.write_files(table, 0, 0, "won"))
    batch(t, 1, [{"user": "a", "n": 3}])
    assert t.sink.collect_orphans(SETTINGS, [1]) == 0
    assert t.sink.collect_orphans(SETTINGS, [0]) == 2
    assert not any((tmp_path / f["path"]).exists() for f in lost)
    assert rows(tmp_path) == [("a", 1), ("a", 3), ("b", 2)]


def test_partition_values_needing_escapes_are_compacted_and_replaced(tmp_path: Path) -> None:
    """The log holds paths URI-encoded (``k=a%2520b``); removes must name the object."""
    t = target(tmp_path, partition_by=("user",))
    odd = [{"user": "a b:c/d%e", "n": 1}, {"user": "plain", "n": 2}]
    table = pa.Table.from_pylist(odd, schema=SCHEMA)
    t.publish(0, t.write_files(table, 0, 0, "x") + t.write_files(table, 0, 1, "x"),
              end_offsets={"t:0": 4})  # fmt: skip
    assert t.optimize()["files_after"] == 2
    assert sorted(n for _, n in rows(tmp_path)) == [1, 1, 2, 2]
    batch(t, 1, [{"user": "a b:c/d%e", "n": 5}], supersedes=[0])
    assert read_delta_sink(str(tmp_path)).to_pylist() == [{"user": "a b:c/d%e", "n": 5}]


def test_stage_refuses_an_incompatible_schema_before_writing_anything(tmp_path: Path) -> None:
    batch(target(tmp_path / "t"), 0, [{"user": "a", "n": 1}])
    retyped = DeltaSink("out", str(tmp_path / "t"), pa.schema([("user", pa.int64())]))
    ctx = StageContext("pipe", 1, 0, SETTINGS, open_store(str(tmp_path / "ck")), Layout(), "a")
    files_before = sorted((tmp_path / "t").rglob("*.parquet"))
    with pytest.raises(SinkError, match=r"pipeline 'pipe' sink 'out'.*column 'user' has type"):
        retyped.stage(ctx, [{"user": 7}])
    assert sorted((tmp_path / "t").rglob("*.parquet")) == files_before


def test_a_schema_delta_cannot_hold_fails_at_stage_naming_the_sink(tmp_path: Path) -> None:
    sink = DeltaSink("out", str(tmp_path / "t"), pa.schema([("took", pa.duration("s"))]))
    ctx = StageContext("pipe", 0, 0, SETTINGS, open_store(str(tmp_path / "ck")), Layout(), "a")
    with pytest.raises(SinkError, match=r"sink 'out'.*no Delta equivalent \(.*Duration"):
        sink.stage(ctx, [{"took": 5}])
    assert not (tmp_path / "t").exists()
