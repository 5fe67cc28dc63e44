"""A window join with ``select=fields(...)`` and both times read from fields joins on
Arrow columns: a person's records (no declared schema: their columns are guessed from
the first and checked on every one) and a window's output rows, paired at once by numpy.
Batch by batch, through a crash and a rescale, its output and dead letters equal the
same join written as a function of two dicts; messy records (an extra field, a time as
text) take the records path and still give the same."""

from __future__ import annotations

import collections
import dataclasses
import json
import random
from pathlib import Path
from typing import Any

import pytest

from microbatch import windows
from microbatch.checkpoint import Layout, latest_manifest
from microbatch.joins import WindowJoin, fields
from microbatch.kafka import TopicPartition
from microbatch.runtime import BatchOptions, BatchRunner, KafkaSource, ParquetSink
from microbatch.runtime import side_columns as side_columns_module
from microbatch.runtime.records import BatchRecord
from microbatch.settings import Settings
from microbatch.sinks import read_parquet_sink
from microbatch.storage import open_store
from microbatch.testing import ProcessHarness, sided
from tests.unit.dataflow.test_joins_at_once import (
    BATCHES,
    SEC,
    crash_then_rescale,
    produce,
    two_topics,
)
from tests.unit.joins.streams import on_columns_against_dicts
from tests.unit.runtime.test_protocol import Log
from tests.unit.runtime.test_window_pre_aggregation import PerPartition, dead_letters

PICK = fields(left=["id", "name"], right={"sold": "count"})


def produce_alike(log: Log, seed: int, start: int, n: int) -> None:
    """People and auctions of people just seen, up to 3 s out of order, every person of
    the same fields and an epoch-ms time; now and then one far behind the watermark."""
    rng = random.Random(seed)
    recent = [f"p{rng.randrange(500):03}" for _ in range(5)]
    for i in range(n):
        ts = start + i * 150 - rng.randrange(3 * SEC)
        if start and rng.random() < 0.03:
            ts = start - 60 * SEC  # late for every window: late_join
        person = {"id": f"p{rng.randrange(500):03}", "name": f"n{i}", "ts": ts}
        recent = [*recent[1:], person["id"]]
        auction = {"seller": rng.choice(recent), "ts": start + i * 150 - rng.randrange(3 * SEC)}
        log.values[TopicPartition("people", i % 2)].append(json.dumps(person).encode())
        log.values[TopicPartition("auctions", (i // 3) % 2)].append(json.dumps(auction).encode())


def run(root: Path, data: str, column_wise: bool) -> tuple[list, list, collections.Counter]:
    log, flow = two_topics("new-users", ("people", "auctions"), 2, root)
    people = flow.source(KafkaSource(topics=("people",)))
    auctions = flow.source(KafkaSource(topics=("auctions",)))
    sellers = auctions.key_by("seller").window(
        windows.tumbling("10s").count().final(), uid="sellers"
    )
    select = PICK if column_wise else (lambda p, s: PICK(p, s))
    join = WindowJoin("ts", "window_start", "10s", select=select)
    people.key_by("id").join(sellers.key_by("key"), join, uid="new-users").to(
        ParquetSink("out", str(root / "out"))
    )
    make = produce_alike if data == "alike" else produce
    out, counters = run_batches(flow.build(), log, root / "out", make, column_wise)
    return out, dead_letters(root / "dead"), counters


def run_batches(
    pipeline: Any, log: Log, out: Path, make: Any, column_wise: bool
) -> tuple[list[list[str]], collections.Counter]:
    """Each of ``BATCHES``, made by ``make`` and run — column-wise, batch 2 crashes in
    stage 2 and is replayed, batch 3 on rescales — and the sink's rows after each
    (sorted, as JSON), with the instance counters of every batch summed."""
    settings = dataclasses.replace(Settings.from_env(), spark_master="local[1]")
    rows_after, counters = [], collections.Counter()
    for n, (start, count) in enumerate(BATCHES):
        make(log, seed=n, start=start, n=count)
        runner = BatchRunner(None, pipeline, settings, executor=PerPartition(log), broker=log)
        if column_wise:
            crash_then_rescale(runner, n)
        else:
            runner.run(BatchOptions(run_id="r"))
        rows = read_parquet_sink(str(out)).to_pylist()
        rows_after.append(sorted(json.dumps(r, sort_keys=True) for r in rows))
        counters += counters_of(pipeline, settings)
    return rows_after, counters


def assert_same_as_dicts(want: tuple[list, list, Any], got: tuple[list, list, Any]) -> None:
    """A dataflow join's sink rows batch by batch and dead letters, ``(out, dead,
    counters)``, on columns (``got``) equal those of dicts (``want``), with late records
    among them; some keys on columns, not all (those with a late record go to
    ``process``)."""
    (want_out, want_dead, want_counts), (got_out, got_dead, got_counts) = want, got
    assert got_out == want_out
    assert got_dead == want_dead
    assert all(len(batch) > 20 for batch in want_out), [len(b) for b in want_out]
    assert any(d[0] == "late_join" for d in want_dead)
    columns = sum(v for k, v in got_counts.items() if k.endswith("keys_as_columns"))
    keys = sum(v for k, v in got_counts.items() if k.endswith(".keys") or k == "keys")
    assert 0 < columns < keys, got_counts
    assert not any(k.endswith("keys_as_columns") for k in want_counts)


def counters_of(pipeline: Any, settings: Settings) -> collections.Counter:
    """The instance counters of the pipeline's last committed batch, summed."""
    manifest = latest_manifest(open_store(pipeline.checkpoints, settings), Layout())
    stats = BatchRecord.of(manifest).stats
    counters: collections.Counter = collections.Counter()
    for instance in stats.instances if stats else ():
        counters.update(instance.counters)
    return counters


@pytest.mark.parametrize("data", ["alike", "messy"])
def test_a_window_join_on_columns_gives_what_the_join_of_dicts_gives(
    tmp_path: Path, data: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    want_out, want_dead, want_counts = run(tmp_path / "dicts", data, column_wise=False)
    if data == "alike":  # every key it takes it joins on columns: decoding them fails

        def no_records(self: Any) -> Any:
            raise AssertionError("the column-wise join decoded its records")

        monkeypatch.setattr(side_columns_module.RecordsOnUse, "_all", no_records)
    got_out, got_dead, got_counts = run(tmp_path / "columns", data, column_wise=True)

    assert got_out == want_out
    assert got_dead == want_dead
    assert all(len(batch) > 20 for batch in want_out[1:]), [len(b) for b in want_out]
    late = [d for d in want_dead if d[0] == "late_join"]
    assert late, "some people should come too late for every window"
    columns = sum(v for k, v in got_counts.items() if k.endswith("keys_as_columns"))
    assert not any(k.endswith("keys_as_columns") for k in want_counts)
    if data == "alike":
        assert columns > 100, got_counts
    else:  # an extra field or a time as text in every batch: no side is a table
        assert columns == 0, got_counts
    row = json.loads(got_out[-1][0])
    assert set(row) == {"id", "name", "sold", "window_start", "window_end"}


@pytest.mark.parametrize(
    ("seed", "window"),
    [(1, windows.tumbling(100).spec), (2, windows.tumbling(1_000).spec),
     (3, windows.hopping(300, every=100).spec), (4, windows.hopping(250, every=100).spec)],
)  # fmt: skip
def test_keys_on_columns_leave_the_state_and_output_process_leaves(seed: int, window: Any) -> None:
    """Out of order, late records, windows open across batches and held in state,
    rescales: after every batch each key's output (in order), the dead letters and each
    key's state and timers are those of the same join of dicts."""
    pick = fields(left={"l": "id", "k": "k"}, right={"r": "id"})
    seen = on_columns_against_dicts(
        lambda select: WindowJoin("ts", "ts", window, select=select), pick, seed
    )
    assert seen.keys_as_columns > 20
    assert seen.timers_fired < seen.timers_fired_by_dicts  # a window it closes takes its timer


def test_a_window_closes_at_the_watermark_of_its_end_and_is_late_after_it() -> None:
    pick = fields(left={"l": "id", "k": "k"}, right={"r": "id"})
    on_columns, by_dicts = (
        ProcessHarness(WindowJoin("ts", "ts", 100, select=select), 16)
        for select in (pick, lambda a, b: pick(a, b))
    )

    def record(i: str, t: int) -> tuple[str, dict]:
        return ("a", {"id": i, "k": "a", "ts": t})

    def state(left: dict, right: dict, timers: list) -> dict:
        held = {"left": left, "right": right, "timers": timers}
        return {k: v for k, v in held.items() if v}

    times = (("L1", 10), ("L2", 50), ("R1", 150), ("R2", 20), ("R3", 120))
    l1, l2, r1, r2, r3 = (record(i, t)[1] for i, t in times)
    batches = [  # (left, right, watermark, pairs, dead letters, on columns, state after)
        ([l1], [r1], 99, [], [], 1, state({0: [l1]}, {100: [r1]}, [100, 200])),  # stays open
        ([], [r2], 100, [("L1", "R2")], [], 1, state({}, {100: [r1]}, [200])),  # closes at 100
        ([l2], [r3], 150, [], ["L2"], 0, state({}, {100: [r1, r3]}, [200])),  # [0, 100) closed
    ]
    for lefts, rights, watermark, pairs, dead, columns, after in batches:
        records = sided([("a", r) for r in lefts], [("a", r) for r in rights])
        got, want = (h.batch(records, watermark=watermark) for h in (on_columns, by_dicts))
        assert got.emitted == want.emitted
        assert [(r["l"], r["r"]) for r in got.emitted] == pairs
        assert got.dead_letters == want.dead_letters
        assert [d.record["id"] for d in got.dead_letters] == dead
        assert on_columns.state("a") == by_dicts.state("a") == after
        assert got.keys_as_columns == columns  # a key with a late record goes to process
