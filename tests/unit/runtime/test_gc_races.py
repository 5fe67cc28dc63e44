"""Retention racing other runs: a stalled attempt (a zombie) collecting garbage, or
committing, while the run that took its lease over goes on. Each race is driven in this
process: a store wrapper runs the other run's steps at the moment the zombie would stall,
so the interleaving is the worst one, every time."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import pytest

from microbatch.checkpoint import Layout, list_checkpoints, load_manifest
from microbatch.errors import CheckpointError, LeaseError
from microbatch.kafka import KafkaBrokerView
from microbatch.runtime import BatchOptions, Pipeline
from microbatch.runtime.retention import collect_batch_garbage
from microbatch.sinks import parquet as ps
from microbatch.storage import ObjectStore, open_store
from tests.unit.runtime.test_protocol import Log, log, pipeline, runner, totals

__all__ = ["log", "pipeline"]  # fixtures shared with test_protocol


class Meanwhile:
    """An object store that runs ``meanwhile`` once, around the ``nth`` call of
    ``method`` on a key starting with ``prefix`` (``before`` it, else after it returns):
    what other runs do while this one stalls there."""

    def __init__(
        self,
        store: ObjectStore,
        method: str,
        prefix: str,
        meanwhile: Callable[[], Any],
        *,
        before: bool = False,
        nth: int = 1,
    ) -> None:
        self._store, self._method, self._prefix, self._before = store, method, prefix, before
        self._calls_left = nth
        self._meanwhile: Callable[[], Any] | None = meanwhile
        self.url = store.url

    def __getattr__(self, name: str) -> Any:
        target = getattr(self._store, name)
        if name != self._method:
            return target

        def call(key: str, *args: Any) -> Any:
            meanwhile = None
            if key.startswith(self._prefix):
                self._calls_left -= 1
                if self._calls_left == 0:
                    meanwhile = self._meanwhile
            if meanwhile is not None and self._before:
                meanwhile()
            result = target(key, *args)
            if meanwhile is not None and not self._before:
                meanwhile()
            return result

        return call


@pytest.fixture(autouse=True)
def stand_in_broker_for_rewinds(monkeypatch: pytest.MonkeyPatch, log: Log) -> None:
    """A rewind asks the brokers whether the records to read again are still there."""
    monkeypatch.setattr(
        KafkaBrokerView, "for_settings", classmethod(lambda cls, *a, **kw: nullcontext(log))
    )


def run_batches(pipeline: Pipeline, log: Log, n: int) -> None:
    for i in range(n):
        log.produce(i % 2, "ann", f"user-{i}")
        runner(pipeline, log).run()


def test_gc_that_stalled_after_listing_keeps_the_files_of_a_rewind_committed_meanwhile(
    pipeline, log
) -> None:
    """Run A passed its lease check, lists checkpoints [2, 3, 4] (retain 2) and stalls;
    run B replays from checkpoint 2, committing 5, a copy naming 2's runs; A wakes and
    collects what it decided on. Later batches must still find every file 5 names."""
    keep_all = dataclasses.replace(pipeline, retain_checkpoints=10)
    run_batches(keep_all, log, 5)
    short = dataclasses.replace(pipeline, retain_checkpoints=2)
    store, layout = open_store(short.checkpoints), Layout()
    replayed = []

    def replay_from_2() -> None:
        replayed.append(runner(short, log).replay_from(2, run_id="b").checkpoint_id)

    stalled = Meanwhile(store, "list", layout.manifests, replay_from_2)
    collect_batch_garbage(stalled, layout, short.retain_checkpoints)  # run A's GC

    assert replayed == [5]
    copy = load_manifest(store, layout, 5)
    assert all(store.exists(f) for f in copy.files()), "GC deleted files checkpoint 5 names"
    log.produce(0, "ann")
    runner(short, log).run()  # batch 6 restores 2's state and reads what came after again
    assert list_checkpoints(store, layout)[-1] == 6
    assert max(n for user, n in totals(short) if user == "ann") == 9  # 3 + 5 + 1 clicks


def test_gc_while_a_rewind_is_about_to_commit_keeps_the_files_of_its_source(pipeline, log) -> None:
    """Run B read checkpoint 2 to replay from it and is about to commit its copy when a
    GC (retain 2) removes checkpoint 2: the copy B then commits must find 2's files."""
    keep_all = dataclasses.replace(pipeline, retain_checkpoints=10)
    run_batches(keep_all, log, 5)
    short = dataclasses.replace(pipeline, retain_checkpoints=2)
    store, layout = open_store(short.checkpoints), Layout()
    b = runner(short, log)
    b.store = Meanwhile(  # type: ignore[assignment]
        b.store,
        "create",
        layout.manifest_key(5),
        lambda: collect_batch_garbage(store, layout, short.retain_checkpoints),
        before=True,
    )

    assert b.replay_from(2, run_id="b").checkpoint_id == 5

    assert 2 not in list_checkpoints(store, layout)  # that GC did remove checkpoint 2
    copy = load_manifest(store, layout, 5)
    assert all(store.exists(f) for f in copy.files()), "GC deleted files checkpoint 5 names"
    assert not store.list(layout.pins)  # the rewind took its pin away
    runner(short, log).run()  # batch 6 restores 2's state
    assert max(n for user, n in totals(short) if user == "ann") == 8  # 3 + 5 clicks


def test_a_rewind_whose_source_gc_removed_after_it_was_read_commits_nothing(pipeline, log) -> None:
    """Run B read checkpoint 2 to replay from it; a GC removes 2 and the files only it
    named before B commits. B must refuse, saying what happened, rather than commit a
    copy naming deleted files."""
    keep_all = dataclasses.replace(pipeline, retain_checkpoints=10)
    run_batches(keep_all, log, 5)
    short = dataclasses.replace(pipeline, retain_checkpoints=2)
    store, layout = open_store(short.checkpoints), Layout()
    b = runner(short, log)
    b.store = Meanwhile(  # type: ignore[assignment]
        b.store,
        "get",
        layout.manifest_key(2),
        lambda: collect_batch_garbage(store, layout, short.retain_checkpoints),
    )

    with pytest.raises(CheckpointError, match=r"checkpoint 2 .*retention"):
        b.replay_from(2, run_id="b")

    assert list_checkpoints(store, layout) == [3, 4] and not store.list(layout.pins)
    runner(short, log).run()  # the pipeline goes on from 4
    assert max(n for user, n in totals(short) if user == "ann") == 8


def test_a_rewind_that_finds_its_source_gone_once_pinned_commits_nothing(pipeline, log) -> None:
    """As above, but the GC runs after B checked that checkpoint 2 is retained and
    before B pins it: B reads 2 again once pinned, finds it gone and stops."""
    keep_all = dataclasses.replace(pipeline, retain_checkpoints=10)
    run_batches(keep_all, log, 5)
    short = dataclasses.replace(pipeline, retain_checkpoints=2)
    store, layout = open_store(short.checkpoints), Layout()
    b = runner(short, log)
    b.store = Meanwhile(  # type: ignore[assignment]
        b.store,
        "list",
        layout.manifests,
        lambda: collect_batch_garbage(store, layout, short.retain_checkpoints),
        nth=2,  # the first finds the newest checkpoint, the second the floor below 2
    )

    left = r"rewinding to checkpoint 2: checkpoint 2 left retention while this run was rewinding"
    with pytest.raises(CheckpointError, match=left):
        b.replay_from(2, run_id="b")

    assert list_checkpoints(store, layout) == [3, 4] and not store.list(layout.pins)


MINUTE = 60_000
T = [1_700_000_000_000 + i * MINUTE for i in range(6)]  # interval boundaries T0..T5


def interval(i: int, run_id: str, **more: Any) -> BatchOptions:
    return BatchOptions(run_id=run_id, interval_start_ms=T[i], until_timestamp_ms=T[i + 1], **more)


def test_an_orphan_manifest_of_a_stalled_attempt_is_never_a_backfills_rewind_target(
    pipeline, log
) -> None:
    """Attempt A of batch 2 passes the newest-checkpoint test and stalls before its
    exclusive create; its retry commits 2, then batches 3 and 4 commit and retention
    (retain 2) removes checkpoint 2 and its files; A wakes and creates manifests/2. A
    backfill of [T3, T4) must not rewind to that orphan (it names deleted files, and
    every later batch would fail): it is refused like any checkpoint retention removed,
    and the pipeline goes on."""
    short = dataclasses.replace(pipeline, retain_checkpoints=2)
    store, layout = open_store(short.checkpoints), Layout()
    for i in range(2):
        log.produce(i % 2, "ann")
        runner(short, log).run(interval(i, f"s{i}"))
    log.produce(0, "ann")

    def retry_then_two_more_batches() -> None:
        runner(short, log).run(interval(2, "a"))  # the same run id takes the lease at once
        for i in (3, 4):
            log.produce(1, "bob")
            runner(short, log).run(interval(i, f"s{i}"))

    a = runner(short, log)
    a.store = Meanwhile(  # type: ignore[assignment]
        a.store, "create", layout.manifest_key(2), retry_then_two_more_batches, before=True
    )
    with pytest.raises(LeaseError, match="lost the lease"):
        a.run(interval(2, "a"))
    assert store.exists(layout.manifest_key(2))  # the orphan
    assert list_checkpoints(store, layout) == [3, 4]

    with pytest.raises(CheckpointError, match=r"no retained checkpoint ended there"):
        runner(short, log).run(interval(3, "backfill", backfill=True))

    log.produce(0, "ann")
    assert runner(short, log).run().batch_id == 5  # not wedged
    assert max(n for user, n in totals(short) if user == "ann") == 7  # 3 + 2 + 1 + 1 clicks
    assert not store.exists(layout.manifest_key(2))  # GC removed the orphan


def test_a_batch_leaving_retention_loses_its_plan_before_its_orphans_are_collected(
    pipeline, log
) -> None:
    """The retention half of the handshake with late stagers: when the sinks collect a
    batch's orphans its plan is already gone, and its published mark still there (so a
    crash in between collects again)."""
    seen = []

    def before_dropping(batches) -> None:
        store = open_store(pipeline.checkpoints)
        seen.extend(
            (b, store.exists(layout.plan_key(b)), store.exists(layout.published_key(b)))
            for b in batches
        )

    run_batches(pipeline, log, 2)
    layout = Layout()
    collect_batch_garbage(open_store(pipeline.checkpoints), layout, 1, before_dropping)

    assert seen == [(0, False, True)]
    assert not open_store(pipeline.checkpoints).exists(layout.published_key(0))


def test_a_zombie_part_staged_while_its_batch_leaves_retention_does_not_outlive_it(
    pipeline, log
) -> None:
    """A fenced attempt of batch 0 whose stage-2 task still runs writes a Parquet part
    right after retention collected batch 0's orphans. A stager that checks, after
    writing, that its batch's plan still exists (the sink-side half of the handshake,
    done here by hand) then finds it gone and removes its part."""
    short = dataclasses.replace(pipeline, retain_checkpoints=1)
    layout = Layout()
    checkpoints = open_store(short.checkpoints)
    sink = open_store(short.sinks[0].url)  # type: ignore[attr-defined]
    zombie_part = ps.data_key(0, 0, "0badc0ffee00")

    def stage_late() -> None:
        sink.put(zombie_part, b"rows of a fenced attempt")
        if not checkpoints.exists(layout.plan_key(0)):
            sink.delete(zombie_part)

    runner(short, log).run()
    log.produce(0, "bob")
    second = runner(short, log)
    collect = second.collect_orphans

    def collect_then_zombie_stages(batches) -> None:
        collect(batches)
        stage_late()

    second.collect_orphans = collect_then_zombie_stages  # type: ignore[method-assign]
    second.run()  # batch 1: batch 0 leaves retention

    listed = set(json.loads(sink.get(ps.commit_key(0)))["files"])
    assert set(sink.list(ps.batch_prefix(0))) == listed
