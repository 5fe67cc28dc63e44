"""A temporal join with ``select=fields(...)`` and both times read from fields takes a
batch's keys at once, on columns: versions and waiting left records read back from
state, every left record the watermark passes looked up at once. Batch by batch, through
rescales and reruns, with records late and records waiting across batches, it leaves the
state, timers and output of each key that ``process`` and its timers leave."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest

from microbatch.joins import TemporalJoin, fields
from microbatch.kafka import TopicPartition
from microbatch.runtime import KafkaSource, ParquetSink
from microbatch.testing import ProcessHarness, sided
from tests.unit.dataflow.test_joins_at_once import SEC, two_topics
from tests.unit.joins.streams import (
    arrival_order,
    events,
    lagging_watermarks,
    on_columns_against_dicts,
    split,
)
from tests.unit.joins.test_window_columns import assert_same_as_dicts, run_batches
from tests.unit.runtime.test_protocol import Log
from tests.unit.runtime.test_window_pre_aggregation import dead_letters

PICK = fields(left={"l": "id", "k": "k", "t": "ts"}, right={"r": "id", "rt": "ts"})


def late_batches(seed: int, n: int = 10) -> tuple[list[list[Any]], list[int | None]]:
    arrived = arrival_order(events(seed, 80, keys="abcdefgh"), seed, disorder=100, late_share=0.2)
    cut = split(arrived, seed, n)
    return cut, lagging_watermarks(cut, lateness=50)


@pytest.mark.parametrize("how", ["inner", "left"])
@pytest.mark.parametrize(("seed", "retention"), [(1, 1), (2, 30), (3, 150), (4, 300)])
def test_keys_on_columns_leave_the_state_and_output_process_leaves(
    how: str, seed: int, retention: int
) -> None:
    """Out of order, late records, records waiting across batches, versions held for the
    retention, rescales: after every batch each key's output (in order), the dead
    letters and each key's state and timers are those of the same join of dicts."""
    seen = on_columns_against_dicts(
        lambda select: TemporalJoin("ts", "ts", retention, select=select, how=how),
        PICK,
        seed,
        drains=False,  # a key's last version stays
    )
    assert seen.keys_as_columns > 10


def test_a_rerun_from_a_checkpoint_on_columns_gives_the_same_output_and_state() -> None:
    batches, watermarks = late_batches(7, n=6)
    harness = ProcessHarness(TemporalJoin("ts", "ts", 100, select=PICK, how="left"), 16)
    for batch, watermark in zip(batches, watermarks, strict=True):
        pairs = sided(
            [(e.key, e.record) for e in batch if e.side == 0],
            [(e.key, e.record) for e in batch if e.side == 1],
        )
        saved = harness.checkpoint()
        first = harness.batch(pairs, watermark=watermark)
        state = {k: harness.state(k) for k in "abcdefgh"}
        harness.restore(saved)
        again = harness.batch(pairs, watermark=watermark)
        assert again == first
        assert {k: harness.state(k) for k in "abcdefgh"} == state


def test_a_left_record_waits_in_state_until_the_watermark_passes_it() -> None:
    join = TemporalJoin("ts", "ts", 100, select=PICK)
    harness = ProcessHarness(join, 16)
    rate = {"id": "R1", "k": "a", "ts": 10}
    held = harness.batch(
        sided([("a", {"id": "L1", "k": "a", "ts": 50})], [("a", rate)]), watermark=50
    )
    assert held.emitted == () and held.keys_as_columns == 1
    assert harness.state("a")["pending"] == {50: [{"id": "L1", "k": "a", "ts": 50}]}
    assert harness.state("a")["timers"] == [51, 110]
    late_rate = {"id": "R2", "k": "a", "ts": 40}  # arrives before the watermark passes 50
    passed = harness.batch(
        sided([("a", {"id": "L2", "k": "a", "ts": 51})], [("a", late_rate)]), watermark=60
    )
    assert [(r["l"], r["r"]) for r in passed.emitted] == [("L1", "R2"), ("L2", "R2")]
    assert passed.keys_as_columns == 1
    assert "pending" not in harness.state("a")


def test_of_two_versions_at_one_time_the_later_holds_in_the_batch_and_across_batches() -> None:
    harness = ProcessHarness(TemporalJoin("ts", "ts", 100, select=PICK), 16)

    def version(i: str, t: int) -> tuple[str, dict]:
        return ("a", {"id": i, "k": "a", "ts": t})

    def order(i: str, t: int) -> tuple[str, dict]:
        return ("a", {"id": i, "k": "a", "ts": t})

    first = harness.batch(
        sided([order("L1", 20)], [version("R1", 10), version("R2", 10), version("R0", 5)]),
        watermark=30,
    )
    assert [(r["l"], r["r"]) for r in first.emitted] == [("L1", "R2")]
    again = harness.batch(sided([order("L2", 40)], [version("R3", 10)]), watermark=50)
    assert [(r["l"], r["r"]) for r in again.emitted] == [("L2", "R3")]
    assert first.keys_as_columns == again.keys_as_columns == 1
    assert harness.state("a")["versions"] == {5: version("R0", 5)[1], 10: version("R3", 10)[1]}


CURRENCIES = [f"c{i:02}" for i in range(40)]


def produce_rates(log: Log, seed: int, start: int, n: int) -> None:
    """Orders and rate versions of 40 currencies, up to 3 s out of order, records of one
    shape each; now and then one far behind the watermark (a late order, or a version
    older than one in force: ``late_join``)."""
    rng = random.Random(seed)
    for i in range(n):
        ts = start + i * 150 - rng.randrange(3 * SEC)
        if start and rng.random() < 0.03:
            ts = start - 60 * SEC
        order = {"id": f"o{seed}-{i}", "cur": rng.choice(CURRENCIES), "amount": i, "ts": ts}
        rate_ts = start + i * 150 - rng.randrange(3 * SEC)
        if start and rng.random() < 0.03:
            rate_ts = start - 60 * SEC
        rate = {"cur": rng.choice(CURRENCIES), "rate": rng.randrange(50, 150) / 100, "ts": rate_ts}
        log.values[TopicPartition("orders", i % 2)].append(json.dumps(order).encode())
        log.values[TopicPartition("rates", (i // 3) % 2)].append(json.dumps(rate).encode())


def run(root: Path, column_wise: bool) -> tuple[list, list, Any]:
    log, flow = two_topics("priced", ("orders", "rates"), 2, root)
    orders = flow.source(KafkaSource(topics=("orders",)))
    rates = flow.source(KafkaSource(topics=("rates",)))
    pick = fields(left=["id", "cur", "amount", "ts"], right={"rate": "rate", "rate_ts": "ts"})
    select = pick if column_wise else (lambda o, r: pick(o, r))
    join = TemporalJoin("ts", "ts", "10s", select=select, how="left")
    orders.key_by("cur").join(rates.key_by("cur"), join, uid="priced").to(
        ParquetSink("out", str(root / "out"))
    )
    out, counters = run_batches(flow.build(), log, root / "out", produce_rates, column_wise)
    return out, dead_letters(root / "dead"), counters


def test_a_temporal_join_on_columns_gives_what_the_join_of_dicts_gives(tmp_path: Path) -> None:
    assert_same_as_dicts(run(tmp_path / "dicts", False), run(tmp_path / "columns", True))
