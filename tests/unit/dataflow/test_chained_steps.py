"""A keyed step that reads a window on the window's own key (``.key_by("key")``, nothing
between) runs in the window's level: no exchange of its own, the window's records for it
handed over in the task. Only where the key is provably kept; the output is exactly what
the step's own exchange gives, through a crash, a replay and a rescale."""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from microbatch import windows
from microbatch.dataflow import Dataflow
from microbatch.errors import BatchError
from microbatch.joins import WindowJoin
from microbatch.kafka import TopicPartition
from microbatch.runtime import (
    BatchRunner,
    EventTime,
    KafkaSource,
    ParquetSink,
    Pipeline,
    spine,
)
from microbatch.runtime.envelope import ENVELOPE_SCHEMA, RECORD
from microbatch.runtime.stage_two import StageTwo
from microbatch.settings import Settings
from microbatch.sinks import read_parquet_sink
from tests.unit.dataflow import test_joins_at_once
from tests.unit.dataflow.test_joins_at_once import crash_then_rescale, two_topics
from tests.unit.runtime import test_window_pre_aggregation
from tests.unit.runtime.test_stage_one import Noop
from tests.unit.runtime.test_window_pre_aggregation import PerPartition, dead_letters


def counted_then(then: str) -> Pipeline:
    """orders → a count per account per minute → ``then`` → a step keyed by 'key'."""
    flow = Dataflow("chain", checkpoints="/tmp/chain", event_time=EventTime("ts"))
    orders = flow.source(KafkaSource(topics=("orders",)))
    name = "key" if then == "aggregate named key" else "count"
    counts = orders.key_by("account").window(
        windows.tumbling("1m").count(name).final(), uid="counts"
    )
    if then == "map":
        counts = counts.map(lambda r: {**r, "key": r["key"] + "!"})
    if then == "process":
        counts = counts.key_by("account").process(Noop(), uid="noop")
    key = (lambda r: r["key"]) if then == "key function" else "key"
    counts.key_by(key).process(Noop(), uid="after").to(ParquetSink("o", "/tmp/o"))
    return flow.build()


def levels(pipeline: Pipeline) -> list[list[str]]:
    stage = StageTwo(pipeline, Settings.from_env(), 7, 2, None, None, 1_000_000)
    return [[s.step or pipeline.uid or "" for s in level] for level in spine.step_levels(stage)]


def test_a_step_on_a_windows_own_key_runs_in_the_windows_level() -> None:
    assert levels(counted_then("nothing")) == [["counts", "after"]]


@pytest.mark.parametrize("then", ["map", "key function", "aggregate named key", "process"])
def test_a_step_whose_key_may_differ_from_the_windows_gets_its_own_exchange(then: str) -> None:
    got = levels(counted_then(then))
    assert got[-1] == ["after"] and len(got) >= 2, got


def levels_counted(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The number of levels of each batch's spine the in-process executor runs, from now
    on (appended as they run)."""
    seen: list[int] = []

    def counted(stage: StageTwo) -> list[list[StageTwo]]:
        out = spine.step_levels(stage)
        seen.append(len(out))
        return out

    monkeypatch.setattr(test_window_pre_aggregation, "step_levels", counted)
    return seen


def test_chained_steps_give_exactly_what_their_own_exchanges_give(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Nexmark q8 in miniature (a count per seller joined with people in its window) and
    two joins of sources beside it: sinks batch by batch and dead letters equal with the
    join chained to the count and with an exchange between them."""
    seen = levels_counted(monkeypatch)
    got_out, got_dead, _ = test_joins_at_once.run(tmp_path / "chained")
    chained, seen[:] = list(seen), []
    with monkeypatch.context() as m:
        m.setattr(spine, "keeps_key", lambda edge, origin: False)
        want_out, want_dead, _ = test_joins_at_once.run(tmp_path / "exchanged")

    assert chained and set(chained) == {1}, chained  # the join in the count's level
    assert seen and set(seen) == {2}, seen  # the join after an exchange of its own
    assert all(len(want_out[sink][-1]) > 50 for sink in want_out)
    assert {"late_join", "missing_key"} <= {d[0] for d in want_dead}
    assert got_out == want_out
    assert got_dead == want_dead


def per_user(flow: Dataflow, topic: str, uid: str) -> Any:
    source = flow.source(KafkaSource(topics=(topic,)))
    return source.key_by("user").window(windows.tumbling("10s").count().final(), uid=uid)


def both_counts(clicks: dict, buys: dict) -> dict:
    return {"user": clicks["key"], "clicks": clicks["count"], "buys": buys["count"]}


def two_windows_joined(tmp_path: Path) -> tuple[list[list[str]], list]:
    """Clicks and purchases counted per user and 10 s window, the two counts joined on the
    user in the window (both ways in keep the key): sink rows batch by batch and dead
    letters, through a crash and a rescale."""
    log, flow = two_topics("counts-joined", ("clicks", "buys"), 1, tmp_path)
    clicks, buys = per_user(flow, "clicks", "clicks"), per_user(flow, "buys", "buys")
    join = WindowJoin("window_start", "window_start", "10s", select=both_counts)
    clicks.key_by("key").join(buys.key_by("key"), join, uid="both").to(
        ParquetSink("both", str(tmp_path / "both"))
    )
    pipeline = flow.build()
    settings = dataclasses.replace(Settings.from_env(), spark_master="local[1]")
    rng, out, executor = random.Random(7), [], PerPartition(log)
    for n in range(4):
        for i in range(300):
            ts = n * 30_000 + i * 100 - rng.randrange(2_000)
            user = f"u{rng.randrange(60)}"
            topic = "buys" if i % 3 == 0 else "clicks"
            log.values[TopicPartition(topic, i % 2)].append(
                json.dumps({"user": user, "ts": ts}).encode()
            )
        crash_then_rescale(BatchRunner(None, pipeline, settings, executor=executor, broker=log), n)
        rows = read_parquet_sink(str(tmp_path / "both")).to_pylist()
        out.append(sorted(json.dumps(r, sort_keys=True) for r in rows))
    return out, dead_letters(tmp_path / "dead")


def test_a_join_of_two_windows_on_their_key_runs_in_their_level_as_it_would_after_an_exchange(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen = levels_counted(monkeypatch)
    got, got_dead = two_windows_joined(tmp_path / "chained")
    chained, seen[:] = list(seen), []
    with monkeypatch.context() as m:
        m.setattr(spine, "keeps_key", lambda edge, origin: False)
        want, want_dead = two_windows_joined(tmp_path / "exchanged")
    assert set(chained) == {1} and set(seen) == {2}, (chained, seen)
    assert len(want[-1]) > 50, want[-1]
    assert got == want
    assert got_dead == want_dead


def test_records_that_would_leave_the_instance_fail_the_batch_naming_the_steps() -> None:
    pipeline = counted_then("nothing")
    stage = StageTwo(pipeline, Settings.from_env(), 7, 2, None, None, 1_000_000)
    level = spine.step_levels(stage)[0]
    cols = {f.name: pa.nulls(2, f.type) for f in ENVELOPE_SCHEMA}
    cols |= {
        "kind": pa.array([RECORD] * 2, pa.string()),
        "topic": pa.array(["@counts>after"] * 2, pa.string()),
        "instance": pa.array([0, 1], pa.int32()),
    }
    records = pa.table(cols, schema=ENVELOPE_SCHEMA)
    with pytest.raises(BatchError, match=r"'chain' batch 7 step 'after'.*instance 1, not 0"):
        spine._hand_over(records, level, 0, 0, {})
