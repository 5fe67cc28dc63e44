"""The Iceberg sink on a SQLite catalog and a local warehouse: one snapshot per batch named
by its summary, reruns and zombies commit nothing twice, backfills replace in one snapshot,
schemas evolve or fail naming the column, and GC never deletes a referenced file."""

from __future__ import annotations

import pickle
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from microbatch.checkpoint import Layout
from microbatch.errors import ConfigError, SinkError
from microbatch.settings import Settings
from microbatch.sinks import IcebergCatalog, IcebergSink, PublishContext, StageContext
from microbatch.sinks.iceberg import IcebergTarget, read_iceberg_sink
from microbatch.sinks.iceberg_commit import commit_snapshot
from microbatch.sinks.iceberg_files import data_file
from microbatch.sinks.replacement import after_batch
from microbatch.storage import open_store

SCHEMA = pa.schema([("user", pa.string()), ("n", pa.int64())])
SETTINGS = Settings.from_env()


@pytest.fixture(autouse=True, scope="module")
def _pyiceberg_threads() -> Iterator[None]:
    """pyiceberg reads manifests on a process-wide thread pool whose idle workers are
    non-daemon threads: stop it, or the run's leaked-thread check fails."""
    from pyiceberg.utils.concurrent import ExecutorFactory

    yield
    if ExecutorFactory._instance is not None:
        ExecutorFactory._instance.shutdown(wait=True)
        ExecutorFactory._instance = None


def catalog(root: Path) -> IcebergCatalog:
    return IcebergCatalog.sql(f"sqlite:///{root / 'catalog.db'}", (root / "wh").as_uri())


def target(root: Path, schema: pa.Schema = SCHEMA, **kw: Any) -> IcebergTarget:
    sink = IcebergSink("out", "lake.events", schema, catalog=catalog(root), **kw)
    return IcebergTarget(sink, "pipe", SETTINGS)


def write(t: IcebergTarget, batch_id: int, rows: list[dict], attempt: str = "") -> list[dict]:
    table = pa.Table.from_pylist(rows, schema=t.sink.schema)
    return t.write_files(table, batch_id, 0, attempt or f"a{batch_id}")


def batch(t: IcebergTarget, batch_id: int, rows: list[dict], **kw: Any) -> bool:
    return t.publish(batch_id, write(t, batch_id, rows), **kw)


def rows(t: IcebergTarget) -> list[tuple]:
    return sorted(tuple(r.values()) for r in read_iceberg_sink(t.sink, SETTINGS).to_pylist())


def snapshots(t: IcebergTarget) -> list[dict[str, Any]]:
    """(batch, operation, added, deleted files) of each snapshot, oldest first."""
    out = []
    for s in t.load().snapshots():
        summary = s.summary.additional_properties
        out.append(
            {
                "batch": summary.get("microbatch.batch"),
                "operation": s.summary.operation.value,
                "added": int(summary.get("added-data-files", 0)),
                "deleted": int(summary.get("deleted-data-files", 0)),
            }
        )
    return out


def test_a_batch_commits_once_in_one_snapshot_naming_it(tmp_path: Path) -> None:
    t = target(tmp_path)
    files = write(t, 0, [{"user": "a", "n": 1}])
    assert t.publish(0, files, end_offsets={"t:0": 1})
    assert not t.publish(0, files)  # the rerun after a crash: nothing
    assert batch(t, 1, [{"user": "b", "n": 2}])
    assert rows(t) == [("a", 1), ("b", 2)]
    assert [(s["batch"], s["added"]) for s in snapshots(t)] == [("0", 1), ("1", 1)]
    summary = t.load().snapshots()[0].summary.additional_properties
    assert summary["microbatch.app"] == "pipe/out"
    assert summary["microbatch.end-offsets"] == '{"t:0": 1}'
    assert t.sink.last_published(SETTINGS, "pipe") == 1
    assert t.sink.last_published(SETTINGS, "other") is None
    assert not t.publish(2, [])  # an idle batch makes no snapshot
    assert len(snapshots(t)) == 2


def test_a_zombie_publishing_from_a_stale_table_writes_nothing_twice(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    t = target(tmp_path)
    batch(t, 0, [{"user": "a", "n": 1}])
    mine, zombies = (
        write(t, 1, [{"user": "z", "n": 9}], "won"),
        write(t, 1, [{"user": "z", "n": 9}], "lost"),
    )
    first, stale = t.load(), t.load()  # both read the table before either commits
    assert t.publish(1, mine, table=first)
    with caplog.at_level("INFO", logger="microbatch.sinks.iceberg_target"):
        assert not t.publish(1, zombies, table=stale)  # its commit fails, reloads, finds 1
    assert "batch 1 conflicted" in caplog.text and "already committed" in caplog.text
    assert rows(t) == [("a", 1), ("z", 9)]
    assert [s["batch"] for s in snapshots(t)] == ["0", "1"]


def test_racing_publishes_of_one_batch_commit_it_once(tmp_path: Path) -> None:
    t = target(tmp_path)
    files = {name: write(t, 0, [{"user": "a", "n": 1}], name) for name in ("one", "two")}
    results: dict[str, bool] = {}
    start = threading.Barrier(2)

    def publish(name: str) -> None:
        start.wait()
        results[name] = target(tmp_path).publish(0, files[name])

    threads = [threading.Thread(target=publish, args=(n,)) for n in files]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert sorted(results.values()) == [False, True]
    assert rows(t) == [("a", 1)]
    assert [s["batch"] for s in snapshots(t)] == ["0"]


def test_a_foreign_commit_after_our_load_is_kept_and_retried_over(tmp_path: Path) -> None:
    t = target(tmp_path)
    batch(t, 0, [{"user": "a", "n": 1}])
    stale = t.load()
    t.load().append(pa.Table.from_pylist([{"user": "f", "n": 7}], schema=SCHEMA))  # another writer
    files = write(t, 1, [{"user": "a", "n": 5}])
    assert t.publish(1, files, supersedes=[0], table=stale)
    assert rows(t) == [("a", 5), ("f", 7)]
    assert [(s["batch"], s["operation"]) for s in snapshots(t)] == [
        ("0", "append"), (None, "append"), ("1", "overwrite")]  # fmt: skip


def test_a_backfill_replaces_each_undone_batch_in_one_snapshot(tmp_path: Path) -> None:
    t = target(tmp_path)
    for b in range(3):
        batch(t, b, [{"user": f"u{b}", "n": b}], end_offsets={"t:0": 10 * (b + 1)})
    assert t.publish_rewind(3, [1, 2])
    assert not t.publish_rewind(3, [1, 2])  # a rerun
    awaiting = t.sink.awaiting_replacement(SETTINGS, [])
    assert awaiting == {"1": {"t:0": 20}, "2": {"t:0": 30}}
    assert rows(t) == [("u0", 0), ("u1", 1), ("u2", 2)]  # old rows stay until replaced
    for b, ends in ((4, {"t:0": 20}), (5, {"t:0": 30})):
        supersedes, awaiting = after_batch(awaiting, ends)
        batch(t, b, [{"user": f"u{b - 3}", "n": 10 * b}], end_offsets=ends, supersedes=supersedes)
    assert rows(t) == [("u0", 0), ("u1", 40), ("u2", 50)]
    assert [(s["batch"], s["operation"], s["added"], s["deleted"]) for s in snapshots(t)][3:] == [
        ("3", "append", 0, 0), ("4", "overwrite", 1, 1), ("5", "overwrite", 1, 1)]  # fmt: skip
    assert t.awaiting_replacement([]) == {}


def test_a_new_nullable_column_is_added_and_incompatible_schemas_fail_naming_the_column(
    tmp_path: Path,
) -> None:
    batch(target(tmp_path), 0, [{"user": "a", "n": 1}])
    wider = pa.schema([*SCHEMA, pa.field("extra", pa.float64())])
    t = target(tmp_path, wider)
    assert [f.name for f in t.check_schema(t.load())] == ["extra"]
    batch(t, 1, [{"user": "b", "n": 2, "extra": 0.5}])
    assert rows(t) == [("a", 1, None), ("b", 2, 0.5)]
    assert [f.name for f in t.load().schema().fields] == ["user", "n", "extra"]

    retyped = pa.schema([("user", pa.string()), ("n", pa.int32()), ("extra", pa.float64())])
    with pytest.raises(SinkError, match=r"pipeline 'pipe' sink 'out'.*column 'n' has type long"):
        target(tmp_path, retyped).check_schema(t.load())
    strict = pa.schema([*wider, pa.field("id", pa.int64(), nullable=False)])
    with pytest.raises(SinkError, match="new column 'id' is NOT NULL"):
        target(tmp_path, strict).check_schema(t.load())
    with pytest.raises(SinkError, match=r"partitioned by \[\] but the sink says"):
        target(tmp_path, wider, partition_by=("user",)).check_schema(t.load())


def test_a_dropped_required_column_fails_at_stage_before_anything_is_written(
    tmp_path: Path,
) -> None:
    strict = pa.schema([pa.field("user", pa.string(), nullable=False), ("n", pa.int64())])
    batch(target(tmp_path, strict), 0, [{"user": "a", "n": 1}])
    files_before = sorted((tmp_path / "wh").rglob("*.parquet"))
    sink = target(tmp_path, pa.schema([("n", pa.int64())])).sink
    ctx = StageContext("pipe", 1, 0, SETTINGS, open_store(str(tmp_path / "ck")), Layout(), "a")
    with pytest.raises(SinkError, match="column 'user' is required in the table but missing"):
        sink.stage(ctx, [{"n": 2}])
    assert sorted((tmp_path / "wh").rglob("*.parquet")) == files_before
    assert len(snapshots(target(tmp_path, strict))) == 1


def test_stage_writes_partitioned_files_with_field_ids_and_publish_reads_the_index(
    tmp_path: Path,
) -> None:
    import datetime

    schema = pa.schema([("user", pa.string()), ("n", pa.int64()), ("day", pa.date32())])
    t = target(tmp_path, schema, partition_by=("day",))
    store = open_store(str(tmp_path / "ck"))
    day = datetime.date(2026, 11, 25)
    records = [{"user": "a", "n": 1, "day": day}, {"user": "b", "n": 2, "day": None},
               {"user": "c", "n": 3, "day": day}]  # fmt: skip
    staged = [
        t.sink.stage(StageContext("pipe", 0, 0, SETTINGS, store, Layout(), attempt), records)
        for attempt in ("one", "two")
    ]
    assert all(s is not None and s.rows == 3 for s in staged)
    files = sorted((tmp_path / "wh").rglob("*.parquet"))
    by_attempt: dict[str, list[bytes]] = {}
    for p in files:
        by_attempt.setdefault(p.stem.rsplit("-", 1)[1], []).append(p.read_bytes())
    assert by_attempt["one"] == by_attempt["two"]  # same rows, same bytes, own names
    assert {p.parent.name for p in files} == {"day=2026-11-25", "day=null"}
    ids = {f.name: f.field_id for f in t.load().schema().fields}
    written = pq.read_schema(files[0])
    assert {f.name: int(f.metadata[b"PARQUET:field_id"]) for f in written} == ids
    assert "schema.name-mapping.default" not in t.load().properties  # ids, not names

    ctx = PublishContext("pipe", 0, SETTINGS, store, Layout(), (staged[1],), {"t:0": 3})  # type: ignore[arg-type]
    t.sink.publish(ctx)
    t.sink.publish(ctx)
    assert rows(t) == [("a", 1, day), ("b", 2, None), ("c", 3, day)]
    scan = t.load().scan(row_filter="day IS NULL").plan_files()
    assert [task.file.partition[0] for task in scan] == [None]  # partition pruning works
    assert [s["added"] for s in snapshots(t)] == [2]
    assert t.sink.stage(StageContext("pipe", 1, 0, SETTINGS, store, Layout(), "x"), []) is None


def test_collect_orphans_deletes_losing_attempts_but_never_a_referenced_file(
    tmp_path: Path,
) -> None:
    t = target(tmp_path, partition_by=("user",))
    two = [{"user": "a", "n": 1}, {"user": "b", "n": 2}]
    lost = write(t, 0, two, "lost")  # a zombie's, never committed
    batch(t, 0, two, end_offsets={"t:0": 2})
    # A file named like batch 0's that another commit references (a foreign compaction):
    kept = write(t, 0, [{"user": "a", "n": 1}], "foreign")
    commit_snapshot(t.load(), [data_file(t.load(), kept[0], t.where)], [], {})
    # Batch 1 replaced later: its files are only in an older, still live, snapshot.
    old = write(t, 1, [{"user": "a", "n": 3}])
    t.publish(1, old, end_offsets={"t:0": 3})
    t.publish_rewind(2, [1])
    batch(t, 3, [{"user": "a", "n": 4}], end_offsets={"t:0": 3}, supersedes=[1])
    assert t.sink.collect_orphans(SETTINGS, [3]) == 0
    assert t.sink.collect_orphans(SETTINGS, [0, 1]) == 2
    assert not any(Path(f["path"].removeprefix("file://")).exists() for f in lost)
    survivors = [*kept, *old]
    assert all(Path(f["path"].removeprefix("file://")).exists() for f in survivors)
    assert rows(t) == [("a", 1), ("a", 1), ("a", 4), ("b", 2)]


def test_the_sink_pickles_and_bad_definitions_are_config_errors(tmp_path: Path) -> None:
    sink = IcebergSink("out", "lake.events", SCHEMA, catalog={"type": "sql", "uri": "sqlite://"})
    assert pickle.loads(pickle.dumps(sink)) == sink
    assert isinstance(sink.catalog, IcebergCatalog) and sink.catalog.get("type") == "sql"
    with pytest.raises(ConfigError, match=r"schema must be a pyarrow\.Schema"):
        IcebergSink("out", "lake.events", None)
    with pytest.raises(ConfigError, match="partition column 'day' is not in the schema"):
        IcebergSink("out", "lake.events", SCHEMA, partition_by=("day",))
    with pytest.raises(ConfigError, match=r"must be 'namespace\.name'"):
        IcebergSink("out", "events", SCHEMA)
    with pytest.raises(ConfigError, match="PYICEBERG_CATALOG__PROD__CREDENTIAL"):
        IcebergCatalog.rest("https://catalog.example", name="prod", credential="id:secret")


def test_the_dataset_is_the_tables_location(tmp_path: Path) -> None:
    t = target(tmp_path)
    before = t.sink.dataset(SETTINGS)
    batch(t, 0, [{"user": "a", "n": 1}])
    after = t.sink.dataset(SETTINGS)
    assert before == after and after.namespace == "file"
    assert after.name == str(tmp_path / "wh" / "lake" / "events")
