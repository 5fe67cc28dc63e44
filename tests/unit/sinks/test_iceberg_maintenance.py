"""The Iceberg sink's maintenance on a SQLite catalog and a local warehouse: optimize merges a
batch's files in one replace snapshot (each row once, replacement still exact), commits
nothing when its lease check fails or anything moved the table meanwhile, and vacuum
expires old snapshots, keeping what a retried publish reads, then deletes only files no
live snapshot reads and older than the retention."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from microbatch.checkpoint import Layout
from microbatch.errors import ConfigError, SinkError
from microbatch.runtime.fence import FencedError, LeaseState
from microbatch.sinks import iceberg_expire, iceberg_optimize
from microbatch.sinks.iceberg import IcebergTarget
from microbatch.sinks.replacement import after_batch
from microbatch.storage import open_store
from tests.unit.sinks.test_iceberg import (  # noqa: F401 (the fixture stops pyiceberg's pool)
    SETTINGS,
    _pyiceberg_threads,
    rows,
    snapshots,
    target,
)

DAYS = pa.schema([("user", pa.string()), ("n", pa.int64()), ("day", pa.string())])
HOUR = 3600.0


def table(tmp_path: Path, pipeline: str = "pipe") -> IcebergTarget:
    """A table partitioned by day, written by ``pipeline``."""
    t = target(tmp_path, DAYS, partition_by=("day",))
    return t if pipeline == "pipe" else t.sink.target(SETTINGS, pipeline)


def records(b: int) -> list[dict[str, Any]]:
    """Batch ``b``'s six rows, over two days."""
    return [{"user": f"u{b}{i}", "n": 10 * b + i, "day": f"d{i % 2}"} for i in range(6)]


def stage(t: IcebergTarget, b: int, recs: list[dict], attempt: str = "", instances: int = 3):
    """Stage ``recs`` split over ``instances`` (as stage 2 does): each writes one file per day."""
    files = []
    for i in range(instances):
        part = pa.Table.from_pylist(recs[i::instances], schema=DAYS)
        files += t.write_files(part, b, i, attempt or f"a{b}")
    return files


def publish(t: IcebergTarget, b: int, recs: list[dict] | None = None, **kw: Any) -> bool:
    kw.setdefault("end_offsets", {"t:0": 10 * (b + 1)})
    return t.publish(b, stage(t, b, records(b) if recs is None else recs), **kw)


def publish_all(t: IcebergTarget, *batches: int) -> None:
    for b in batches:
        assert publish(t, b)


def expected(*batches: int, extra: Sequence[dict] = ()) -> list[tuple]:
    """The rows of ``batches`` and ``extra``, as :func:`rows` reads them."""
    recs = [*(r for b in batches for r in records(b)), *extra]
    return sorted(tuple(r.values()) for r in recs)


def live_files(t: IcebergTarget) -> list[str]:
    return sorted(task.file.file_path for task in t.load().scan().plan_files())


def on_disk(tmp_path: Path, pattern: str = "*.parquet") -> set[str]:
    return {str(p) for p in (tmp_path / "wh").rglob(pattern)}


def later(hours: float) -> Any:
    """A clock ``hours`` ahead of now."""
    return lambda: time.time() + hours * HOUR


# Optimize -------------------------------------------------------------------------------
def test_optimize_merges_each_batch_per_partition_keeping_every_row_once(tmp_path: Path) -> None:
    t = table(tmp_path)
    publish_all(t, 0, 1)
    assert len(live_files(t)) == 12  # 2 batches x 3 instances x 2 days
    first = t.load().snapshots()[0].snapshot_id
    preview = t.optimize(dry_run=True)
    assert preview == {"table": "lake.events", "batches": 2, "files_before": 12,
                       "files_after": 4, "snapshot": None}  # fmt: skip
    assert len(snapshots(t)) == 2 and len(on_disk(tmp_path)) == 12  # a dry run writes nothing

    done = t.optimize()
    assert {k: done[k] for k in ("batches", "files_before", "files_after")} == {
        "batches": 2, "files_before": 12, "files_after": 4}  # fmt: skip
    assert done["snapshot"] == t.load().current_snapshot().snapshot_id
    assert rows(t) == expected(0, 1)
    merged = live_files(t)
    assert len(merged) == 4 and all("-merged-" in p for p in merged)
    assert sorted(t.visible_batches(t.load())) == [0, 1]  # the names keep the batches
    head = snapshots(t)[-1]
    assert (head["operation"], head["added"], head["deleted"]) == ("replace", 4, 12)
    summary = t.load().current_snapshot().summary.additional_properties
    assert json.loads(summary["microbatch.published"]) == {"pipe/out": 1}
    assert t.sink.last_published(SETTINGS, "pipe") == 1
    before = t.load().scan(snapshot_id=first).to_arrow()  # time travel: originals stay
    assert sorted(tuple(r.values()) for r in before.to_pylist()) == expected(0)
    assert t.optimize()["snapshot"] is None  # nothing left to merge
    assert not t.publish(1, stage(t, 1, records(1), "retry"))  # a rerun: nothing


def test_a_backfill_after_optimize_replaces_exactly_that_batchs_rows(tmp_path: Path) -> None:
    t = table(tmp_path)
    publish_all(t, 0, 1, 2)
    t.optimize()
    assert t.publish_rewind(3, [1])
    awaiting = t.sink.awaiting_replacement(SETTINGS, [])
    assert awaiting == {"1": {"t:0": 20}}
    supersedes, _ = after_batch(awaiting, {"t:0": 20})
    again = [{"user": "again", "n": 99, "day": "d0"}]
    assert publish(t, 4, again, end_offsets={"t:0": 20}, supersedes=supersedes)
    assert rows(t) == expected(0, 2, extra=again)
    last = snapshots(t)[-1]
    assert (last["batch"], last["operation"], last["added"], last["deleted"]) == (
        "4",
        "overwrite",
        1,
        2,
    )  # fmt: skip (batch 1's two merged files)


def test_an_optimize_whose_lease_check_fails_commits_nothing_and_leaves_no_file(
    tmp_path: Path,
) -> None:
    t = table(tmp_path)
    publish_all(t, 0, 1)
    files, ops = on_disk(tmp_path, "*"), snapshots(t)

    def fenced() -> None:
        raise FencedError("pipeline 'pipe': run 'optimize-1' lost the lease")

    with pytest.raises(FencedError, match="lost the lease"):
        t.optimize(before_commit=fenced)
    assert snapshots(t) == ops and rows(t) == expected(0, 1)
    assert on_disk(tmp_path, "*") == files  # neither merged files nor manifests remain


def test_a_batch_published_during_an_optimize_makes_it_plan_again(tmp_path: Path) -> None:
    t = table(tmp_path)
    publish_all(t, 0, 1)
    checks: list[int] = []

    def meanwhile() -> None:  # the next batch lands between the merge and the commit
        checks.append(len(checks))
        if len(checks) == 1:
            assert publish(table(tmp_path), 2)

    done = t.optimize(before_commit=meanwhile)
    assert checks == [0, 1] and done["batches"] == 3
    assert rows(t) == expected(0, 1, 2)
    assert [s["operation"] for s in snapshots(t)] == ["append"] * 3 + ["replace"]
    merged = {p for p in on_disk(tmp_path) if "-merged-" in p}
    assert {p.removeprefix("file://") for p in live_files(t)} == merged  # the first plan's went


def test_a_backfill_published_from_before_an_optimize_replaces_the_merged_files(
    tmp_path: Path,
) -> None:
    t = table(tmp_path)
    publish_all(t, 0, 1, 2)
    t.publish_rewind(3, [1])
    again = [{"user": "again", "n": 99, "day": "d1"}]
    files, stale = stage(t, 4, again), t.load()  # the publish loaded the table first
    assert t.optimize()["batches"] == 3
    assert t.publish(4, files, end_offsets={"t:0": 20}, supersedes=[1], table=stale)
    assert rows(t) == expected(0, 2, extra=again)
    assert sorted(t.visible_batches(t.load())) == [0, 2, 4]


def test_the_gc_of_losing_attempts_during_an_optimize_spares_its_merged_files(
    tmp_path: Path,
) -> None:
    t = table(tmp_path)
    lost = stage(t, 0, records(0), "lost")  # a zombie's attempt, never committed
    publish_all(t, 0, 1)
    deleted: list[int] = []
    t.optimize(before_commit=lambda: deleted.append(t.sink.collect_orphans(SETTINGS, [0, 1])))
    assert deleted == [len(lost)]  # the losing attempt's files, not the merged ones
    assert rows(t) == expected(0, 1) and t.load().scan().to_arrow().num_rows == 12


def test_an_optimize_whose_merged_files_a_cleanup_deleted_commits_nothing(
    tmp_path: Path,
) -> None:
    t = table(tmp_path)
    publish_all(t, 0, 1)
    sweeper = table(tmp_path)
    sweeper.clock = later(3)  # its clock is hours ahead: the fresh merged files look old
    with pytest.raises(SinkError, match="were deleted before its commit"):
        t.optimize(before_commit=lambda: sweeper.vacuum(1))
    assert rows(t) == expected(0, 1)
    assert "replace" not in [s["operation"] for s in snapshots(t)]


def test_a_batchs_files_pack_into_merges_up_to_the_target_size() -> None:
    from types import SimpleNamespace

    sizes = {"a": 10, "b": 10, "c": 10, "d": 30, "e": 5}  # d is at the target already
    files = [SimpleNamespace(file_path=p, file_size_in_bytes=n) for p, n in sizes.items()]
    runs = iceberg_optimize._pack(files, target_bytes=25)
    assert [[f.file_path for f in run] for run in runs] == [["a", "b"], ["c", "e"]]
    assert iceberg_optimize._pack(files[:1], target_bytes=25) == []  # one file: nothing


# Vacuum: expire snapshots, then sweep orphans ----------------------------------------------
def test_vacuum_after_optimize_expires_old_snapshots_and_deletes_only_unread_files(
    tmp_path: Path,
) -> None:
    t = table(tmp_path)
    publish_all(t, 0, 1)
    originals = {p.removeprefix("file://") for p in live_files(t)}
    t.optimize()
    assert t.vacuum(1) == []  # everything is younger than the retention
    assert len(snapshots(t)) == 3 and originals <= on_disk(tmp_path)

    t.clock = later(2)
    preview = t.vacuum(1, dry_run=True)
    assert len(snapshots(t)) == 3 and originals <= on_disk(tmp_path)
    gone = t.vacuum(1)
    assert gone == preview
    assert {p.removeprefix("file://") for p in gone if p.endswith(".parquet")} == originals
    assert any(p.endswith(".avro") for p in gone)  # the expired snapshots' manifest lists
    assert [s["operation"] for s in snapshots(t)] == ["replace"]
    assert rows(t) == expected(0, 1)  # the current table reads
    assert not originals & on_disk(tmp_path)
    assert t.vacuum(1) == []


def test_a_retried_publish_after_expiry_writes_nothing_twice(tmp_path: Path) -> None:
    t = table(tmp_path)
    publish_all(t, 0, 1)
    t.optimize()
    t.clock = later(2)
    t.vacuum(1)
    assert [s["batch"] for s in snapshots(t)] == [None]  # no batch snapshot is left...
    assert t.sink.last_published(SETTINGS, "pipe") == 1  # ...the optimize's says it
    assert not publish(t, 1)  # a retried publish, a zombie's other attempt
    assert not t.publish(1, stage(t, 1, records(1), "zombie"), end_offsets={"t:0": 20})
    assert not publish(t, 0)
    assert rows(t) == expected(0, 1)
    assert publish(t, 2) and rows(t) == expected(0, 1, 2)


def test_vacuum_keeps_the_snapshots_a_publish_reads_and_those_within_the_retention(
    tmp_path: Path,
) -> None:
    t = table(tmp_path)
    publish_all(t, 0, 1)
    cut = t.load().current_snapshot().timestamp_ms + 1
    while time.time() * 1000 <= cut:  # what follows is younger than the cut
        pass
    foreign = pa.Table.from_pylist([{"user": "f", "n": 7, "day": "d0"}], schema=DAYS)
    t.load().append(foreign)  # another writer's snapshot, after this app's last
    t.clock = lambda: cut / 1000 + 1 * HOUR
    t.vacuum(1)
    assert [(s["batch"], s["operation"]) for s in snapshots(t)] == [("1", "append"),
                                                                   (None, "append")]  # fmt: skip
    assert not publish(t, 1) and not publish(t, 0)  # batch 1's snapshot tells them
    assert rows(t) == expected(0, 1, extra=[{"user": "f", "n": 7, "day": "d0"}])


def test_vacuum_deletes_only_this_apps_old_unreferenced_files(tmp_path: Path) -> None:
    t = table(tmp_path)
    lost = {f["path"].removeprefix("file://") for f in stage(t, 0, records(0), "lost")}
    publish(t, 0)
    other = table(tmp_path, "other")  # another pipeline, its batch committed, not published
    staged = stage(other, 0, records(5), "x")
    theirs = {f["path"].removeprefix("file://") for f in staged}
    assert t.vacuum(1) == []  # young
    t.clock = later(2)
    gone = {p.removeprefix("file://") for p in t.vacuum(1) if p.endswith(".parquet")}
    assert gone == lost and not lost & on_disk(tmp_path) and theirs <= on_disk(tmp_path)
    assert rows(t) == expected(0)
    assert other.publish(0, staged) and rows(t) == expected(0, 5)


def test_an_expiry_planned_before_another_commit_plans_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    t = table(tmp_path)
    publish_all(t, 0, 1)
    t.optimize()
    plans: list[set[int]] = []
    expirable = iceberg_expire.expirable

    def meanwhile(tbl: Any, cutoff_ms: int) -> set[int]:
        plans.append(expirable(tbl, cutoff_ms))
        if len(plans) == 1:  # another app's batch lands between the plan and the commit
            assert publish(table(tmp_path, "other"), 0, records(7))
        return plans[-1]

    monkeypatch.setattr(iceberg_expire, "expirable", meanwhile)
    t.clock = later(2)
    t.vacuum(1)
    assert len(plans) == 2
    assert [s["operation"] for s in snapshots(t)] == ["replace", "append"]
    assert t.sink.last_published(SETTINGS, "pipe") == 1
    assert table(tmp_path, "other").sink.last_published(SETTINGS, "other") == 0
    assert rows(t) == expected(0, 1, 7)


def test_vacuum_refuses_a_retention_under_an_hour_and_a_missing_pipeline(tmp_path: Path) -> None:
    t = table(tmp_path)
    with pytest.raises(ConfigError, match=r"retention 0\.5 h is below 1 h"):
        t.vacuum(0.5)
    with pytest.raises(ConfigError, match="vacuum needs the pipeline"):
        t.sink.target(SETTINGS, None).vacuum(2)


# Through `microbatch optimize` ------------------------------------------------------------
JOB = """
from microbatch.runtime import KafkaSource, KeyedProcessFunction, Pipeline
from microbatch.sinks import IcebergCatalog, IcebergSink
from tests.unit.sinks.test_iceberg_maintenance import DAYS


class Nothing(KeyedProcessFunction):
    def process(self, key, records, ctx):
        pass


catalog = IcebergCatalog.sql({uri!r}, {warehouse!r})
pipeline = Pipeline(
    name="pipe",
    source=KafkaSource(topics=("clicks",)),
    key_by="user",
    process=Nothing(),
    sinks=[IcebergSink("out", "lake.events", DAYS, catalog=catalog, partition_by=("day",))],
    checkpoints={checkpoints!r},
    max_parallelism=4,
)
"""


def optimize_command(tmp_path: Path, *flags: str) -> Any:
    from microbatch.cli import build_parser

    job = tmp_path / "job.py"
    uri, warehouse = f"sqlite:///{tmp_path / 'catalog.db'}", (tmp_path / "wh").as_uri()
    checkpoints = str(tmp_path / "checkpoints")
    job.write_text(JOB.format(uri=uri, warehouse=warehouse, checkpoints=checkpoints))
    return build_parser().parse_args(["optimize", str(job), "--sink", "out", *flags])


def test_microbatch_optimize_compacts_and_vacuums_an_iceberg_sink(tmp_path: Path) -> None:
    from microbatch.cli import cmd_optimize

    t = table(tmp_path)
    publish_all(t, 0, 1)
    dry = cmd_optimize(optimize_command(tmp_path, "--dry-run", "--vacuum"), SETTINGS)
    assert (dry["files_before"], dry["snapshot"], dry["vacuumed"]) == (12, None, [])
    assert len(snapshots(t)) == 2
    out = cmd_optimize(optimize_command(tmp_path, "--vacuum", "--retention-hours", "1"), SETTINGS)
    assert (out["pipeline"], out["sink"], out["files_after"]) == ("pipe", "out", 4)
    assert out["snapshot"] == t.load().current_snapshot().snapshot_id
    assert out["vacuumed"] == []  # everything is younger than an hour
    assert rows(t) == expected(0, 1)


def test_microbatch_optimize_stalled_past_its_lease_commits_nothing_to_iceberg(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from microbatch.cli import cmd_optimize

    t = table(tmp_path)
    publish_all(t, 0, 1)
    ops, files = snapshots(t), on_disk(tmp_path)
    merge = iceberg_optimize._merge

    def stall_past_the_lease(*args: Any) -> Any:
        out = merge(*args)
        # Meanwhile the next batch run took the lease over (the optimize froze too long).
        next_run = LeaseState(owner="run-2", epoch=99, acquired_ms=1, expires_ms=2)
        open_store(str(tmp_path / "checkpoints")).put(Layout().lease_key, next_run.to_bytes())
        return out

    monkeypatch.setattr(iceberg_optimize, "_merge", stall_past_the_lease)
    with pytest.raises(FencedError, match="before the optimize's commit"):
        cmd_optimize(optimize_command(tmp_path), SETTINGS)
    assert snapshots(t) == ops and on_disk(tmp_path) == files
