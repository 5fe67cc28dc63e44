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
from tests.unit.dataflow.test_joins_at_once import (
    BATCHES,
    SEC,
    crash_then_rescale,
    produce,
    two_topics,
)
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
