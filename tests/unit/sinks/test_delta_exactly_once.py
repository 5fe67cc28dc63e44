"""Issue #30's holes in the Delta sink, on local tables: the GC of losing attempts never
deletes a file a table version references or an optimize is about to commit, an optimize
that lost the pipeline's lease commits nothing, and a second pipeline is refused the
table (naming both) before it can undo or delete the first one's batches."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from deltalake import DeltaTable

from microbatch.checkpoint import Layout
from microbatch.errors import ConfigError
from microbatch.runtime.fence import FencedError, LeaseState
from microbatch.settings import Settings
from microbatch.sinks import DeltaSink, delta_maintenance, read_delta_sink
from microbatch.sinks.delta import DeltaTarget
from microbatch.storage import open_store

SCHEMA = pa.schema([("user", pa.string()), ("n", pa.int64())])
SETTINGS = Settings.from_env()


def target(path: Path, pipeline: str = "pipe", **kw: Any) -> DeltaTarget:
    return DeltaTarget(DeltaSink("out", str(path), SCHEMA, **kw), pipeline, SETTINGS)


def stage(t: DeltaTarget, batch_id: int, attempt: str, per_instance: list[list[dict]]) -> list:
    """What one attempt of a batch stages: each operator instance's rows."""
    return [
        f
        for instance, records in enumerate(per_instance)
        for f in t.write_files(pa.Table.from_pylist(records, schema=SCHEMA), batch_id, instance,
                               attempt)
    ]  # fmt: skip


def rows(path: Path, version: int | None = None) -> list[tuple]:
    table = DeltaTable(str(path), version=version).to_pyarrow_table()
    return sorted(tuple(r.values()) for r in table.to_pylist())


def parquet_files(path: Path) -> set[str]:
    return {str(p.relative_to(path)) for p in path.rglob("*.parquet")}


# GC vs optimize ------------------------------------------------------------------------
def test_gc_between_an_optimizes_merge_and_its_commit_leaves_the_table_readable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    t = target(tmp_path)
    split = [[{"user": "a", "n": 1}], [{"user": "b", "n": 2}]]
    lost = stage(t, 0, "lost", split)  # a zombie's twin of batch 0, never committed
    t.publish(0, stage(t, 0, "won", split))
    before = rows(tmp_path)
    commit = DeltaTable.create_write_transaction

    def gc_first(self: DeltaTable, *args: Any, **kwargs: Any) -> Any:
        # The next batch's GC, run while the optimize's merged file awaits its commit.
        t.sink.collect_orphans(SETTINGS, [0])
        return commit(self, *args, **kwargs)

    monkeypatch.setattr(DeltaTable, "create_write_transaction", gc_first)
    assert t.optimize()["files_after"] == 1
    monkeypatch.undo()
    assert rows(tmp_path) == before  # the merged file the commit names is there
    assert not any((tmp_path / f["path"]).exists() for f in lost)  # losers still collected


def test_gc_keeps_the_files_an_optimize_removed_for_older_versions(tmp_path: Path) -> None:
    t = target(tmp_path, partition_by=("user",))
    # Batch 0: partition a has a file per instance (merged), b one (left as staged).
    split = [[{"user": "a", "n": 1}, {"user": "b", "n": 2}], [{"user": "a", "n": 3}]]
    lost0 = stage(t, 0, "lost", split)
    t.publish(0, stage(t, 0, "won", split))
    # Batch 1: its only partition is merged, so no file shows which attempt won.
    lost1 = stage(t, 1, "lost", [[{"user": "a", "n": 4}], [{"user": "a", "n": 5}]])
    t.publish(1, stage(t, 1, "won", [[{"user": "a", "n": 4}], [{"user": "a", "n": 5}]]))
    before, version = rows(tmp_path), t.load().version()
    assert t.optimize()["files_after"] == 2

    collected = t.sink.collect_orphans(SETTINGS, [0, 1])
    assert rows(tmp_path, version) == before  # time travel to before the optimize
    assert rows(tmp_path) == before
    assert collected == len(lost0)
    assert not any((tmp_path / f["path"]).exists() for f in lost0)
    assert all((tmp_path / f["path"]).exists() for f in lost1)  # left to vacuum


def test_only_files_an_attempt_staged_count_as_an_attempts() -> None:
    from microbatch.sinks.delta_files import staging_attempt

    head = "user=a/mb-0123abcd-b00000000000000000007-i00001-0000-"
    assert staging_attempt(f"{head}3f9c0a1b2d4e.parquet") == "3f9c0a1b2d4e"
    assert staging_attempt(f"{head}merged-v12_0a1b2c3d.parquet") is None
    assert staging_attempt(f"{head}c12.parquet") is None  # merged by an earlier version
    assert staging_attempt("user=a/part-0.parquet") is None


def test_an_optimize_that_fails_its_lease_check_commits_nothing_and_cleans_up(
    tmp_path: Path,
) -> None:
    t = target(tmp_path)
    t.publish(0, stage(t, 0, "won", [[{"user": "a", "n": 1}], [{"user": "b", "n": 2}]]))
    version, files = t.load().version(), parquet_files(tmp_path)

    def fenced() -> None:
        raise FencedError("pipeline 'pipe': run 'optimize-1' lost the lease")

    with pytest.raises(FencedError):
        t.optimize(before_commit=fenced)
    assert t.load().version() == version
    assert parquet_files(tmp_path) == files  # its merged file is gone again


JOB = """
from microbatch.runtime import KafkaSource, KeyedProcessFunction, Pipeline
from microbatch.sinks import DeltaSink
from tests.unit.sinks.test_delta_exactly_once import SCHEMA


class Nothing(KeyedProcessFunction):
    def process(self, key, records, ctx):
        pass


pipeline = Pipeline(
    name="pipe",
    source=KafkaSource(topics=("clicks",)),
    key_by="user",
    process=Nothing(),
    sinks=[DeltaSink("out", {table!r}, SCHEMA)],
    checkpoints={checkpoints!r},
    max_parallelism=4,
)
"""


def test_microbatch_optimize_stalled_past_its_lease_commits_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from microbatch.cli import build_parser, cmd_optimize

    table, checkpoints = tmp_path / "table", tmp_path / "checkpoints"
    job = tmp_path / "job.py"
    job.write_text(JOB.format(table=str(table), checkpoints=str(checkpoints)))
    t = target(table)
    t.publish(0, stage(t, 0, "won", [[{"user": "a", "n": 1}], [{"user": "b", "n": 2}]]))
    version = t.load().version()
    compact = delta_maintenance._compact

    def stall_past_the_lease(target: DeltaTarget, *args: Any) -> Any:
        out = compact(target, *args)
        # Meanwhile the next batch run took the lease over (the optimize froze too long).
        next_run = LeaseState(owner="run-2", epoch=99, acquired_ms=1, expires_ms=2)
        open_store(str(checkpoints)).put(Layout().lease_key, next_run.to_bytes())
        return out

    monkeypatch.setattr(delta_maintenance, "_compact", stall_past_the_lease)
    with pytest.raises(FencedError, match="before the optimize's commit"):
        cmd_optimize(build_parser().parse_args(["optimize", str(job), "--sink", "out"]), SETTINGS)
    assert t.load().version() == version


# One pipeline per table ----------------------------------------------------------------
def test_a_second_pipeline_is_refused_the_table_naming_both_before_any_work(
    tmp_path: Path,
) -> None:
    a, b = target(tmp_path, "alpha"), target(tmp_path, "beta")
    a.publish(0, stage(a, 0, "x", [[{"user": "a", "n": 1}]]))
    refusal = rf"pipeline 'beta' sink 'out' \(Delta table {tmp_path}\).*pipeline 'alpha'"
    with pytest.raises(ConfigError, match=refusal):
        b.sink.last_published(SETTINGS, "beta")  # what the runtime asks first
    version = a.load().version()
    with pytest.raises(ConfigError, match=refusal):
        b.publish(0, stage(b, 0, "y", [[{"user": "b", "n": 2}]]))
    with pytest.raises(ConfigError, match=refusal):
        b.publish_rewind(1, [0])
    assert a.load().version() == version
    assert a.sink.last_published(SETTINGS, "alpha") == 0


def test_two_pipelines_first_publishes_racing_leave_one_writer(tmp_path: Path) -> None:
    names = ("alpha", "beta")
    files = {n: stage(target(tmp_path, n), 0, n, [[{"user": n, "n": 1}]]) for n in names}
    outcome: dict[str, str] = {}
    start = threading.Barrier(2)

    def publish(name: str) -> None:
        start.wait()
        try:
            outcome[name] = str(target(tmp_path, name).publish(0, files[name]))
        except ConfigError:
            outcome[name] = "refused"

    threads = [threading.Thread(target=publish, args=(n,)) for n in names]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert sorted(outcome.values()) == ["True", "refused"]
    winner = next(n for n in names if outcome[n] == "True")
    assert [r["user"] for r in read_delta_sink(str(tmp_path)).to_pylist()] == [winner]


def test_a_table_two_pipelines_wrote_before_owners_were_recorded_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    a, b = target(tmp_path, "alpha"), target(tmp_path, "beta")
    # As earlier versions did: no owner recorded.
    monkeypatch.setattr(DeltaTarget, "claim", lambda self, snapshot: None, raising=False)
    a.publish(0, stage(a, 0, "x", [[{"user": "a", "n": 1}]]), end_offsets={"t:0": 1})
    b.publish(0, stage(b, 0, "y", [[{"user": "b", "n": 2}]]), end_offsets={"t:0": 1})
    monkeypatch.undo()
    assert not (tmp_path / "_microbatch").exists()
    with pytest.raises(ConfigError, match=r"pipeline 'beta'.*written by pipeline 'alpha'"):
        b.sink.last_published(SETTINGS, "beta")
    with pytest.raises(ConfigError, match=r"pipelines 'alpha' and 'beta' both write"):
        a.sink.awaiting_replacement(SETTINGS, [0])
