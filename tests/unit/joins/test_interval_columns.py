"""An interval join with ``select=fields(...)`` and both times read from fields takes
a batch's keys at once, on columns: the records they hold read back from state, their
pairs found by range searches with numpy in the order ``process`` emits them, the
unmatched records of an outer side emitted as the timers would, and what stays written
back. Batch by batch — through a crash and a rescale, with records late and records
held across batches, inner and outer — its output, dead letters, state and timers equal
the same join of dicts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

from microbatch.joins import IntervalJoin, fields
from microbatch.joins import held as held_module
from microbatch.keygroups import KeyGroupRange, encode_key
from microbatch.runtime import KafkaSource, ParquetSink
from microbatch.runtime.process import Handled, KeyedBatch
from microbatch.runtime.side_columns import RecordsOnUse, SideColumns
from microbatch.state.backend import KeyedStateBackend
from microbatch.state.codec import encode_values
from microbatch.testing import ProcessHarness, sided
from tests.unit.dataflow.test_joins_at_once import two_topics
from tests.unit.joins.streams import on_columns_against_dicts
from tests.unit.joins.test_window_columns import assert_same_as_dicts, produce_alike, run_batches
from tests.unit.runtime.test_window_pre_aggregation import dead_letters

PICK = fields(left={"person": "id", "name": "name", "at": "ts"}, right={"sold_at": "ts"})


def run(root: Path, column_wise: bool, how: str = "inner") -> tuple[list, list, Any]:
    log, flow = two_topics("sold-by", ("people", "auctions"), 2, root)
    people = flow.source(KafkaSource(topics=("people",)))
    auctions = flow.source(KafkaSource(topics=("auctions",)))
    select = PICK if column_wise else (lambda p, a: PICK(p, a))
    join = IntervalJoin("ts", "ts", between=("-2s", "1s"), select=select, how=how)
    people.key_by("id").join(auctions.key_by("seller"), join, uid="sold-by").to(
        ParquetSink("out", str(root / "out"))
    )
    out, counters = run_batches(flow.build(), log, root / "out", produce_alike, column_wise)
    return out, dead_letters(root / "dead"), counters


@pytest.mark.parametrize("how", ["inner", "full"])
def test_an_interval_join_on_columns_gives_what_the_join_of_dicts_gives(
    tmp_path: Path, how: str
) -> None:
    assert_same_as_dicts(run(tmp_path / "dicts", False, how), run(tmp_path / "columns", True, how))


def on_columns(join: IntervalJoin, people: list, auctions: list, watermark: int) -> Handled | None:
    """``process_batch`` of one key's batch given as columns, nothing held before."""
    records = [r for _, r in people] + [r for _, r in auctions]
    sides = np.array([0] * len(people) + [1] * len(auctions), dtype=np.int8)
    payloads = pa.array(encode_values(records), pa.binary())
    backend = KeyedStateBackend(8, KeyGroupRange(0, 7))
    batch = KeyedBatch.on_backend(
        backend, [0], [encode_key("k")], RecordsOnUse(lambda i, j: records[i:j], len(records)),
        np.array([0, len(records)]), sides, watermark, None, SideColumns(payloads, sides, {}),
    )  # fmt: skip
    return join.process_batch(batch)


def pairs_in_order(join: IntervalJoin, people: list, auctions: list, column_wise: bool) -> list:
    """What one batch of one key emits, through the harness (records) or the batch hook
    on columns."""
    if not column_wise:
        harness = ProcessHarness(join)
        return list(harness.batch(sided(people, auctions), watermark=10_000).emitted)
    handled = on_columns(join, people, auctions, 10_000)
    assert handled is not None and handled.keys.all() and handled.columns is not None
    return handled.columns.to_pylist()


def test_a_record_that_can_still_pair_after_the_batch_waits_in_state_as_process_leaves_it() -> None:
    """A person at 100 pairs with auctions up to 101: held until the watermark passes 101;
    an auction at 101 pairs with people from 99, held until it passes 103."""
    pick = fields(left=["ts"], right={"r": "ts"})
    on_columns, by_dicts = (
        ProcessHarness(IntervalJoin("ts", "ts", between=(-2, 1), select=select, how="left"))
        for select in (pick, lambda a, b: pick(a, b))
    )
    batches = [
        (sided([("k", {"ts": 100})], []), 101, (), {"left": {100: [[{"ts": 100}, False]]},
                                                      "timers": [102]}),
        (sided([], [("k", {"ts": 101})]), 101, ({"ts": 100, "r": 101},),
         {"left": {100: [[{"ts": 100}, True]]}, "right": {101: [[{"ts": 101}, True]]},
          "timers": [102, 104]}),
        ([], 103, (), {"right": {101: [[{"ts": 101}, True]]}, "timers": [104]}),
        ([], 104, (), {}),
    ]  # fmt: skip
    for records, watermark, emitted, state in batches:
        got = on_columns.batch(records, watermark=watermark)
        want = by_dicts.batch(records, watermark=watermark)
        assert got.emitted == want.emitted == emitted
        assert on_columns.state("k") == by_dicts.state("k") == state
        assert got.keys_as_columns == (1 if records else 0)


@pytest.mark.parametrize("bounds", [(-2, 1), (0, 0), (-5, -1), (3, 9)])
def test_pairs_come_in_the_order_process_emits_them(bounds: tuple[int, int]) -> None:
    rng = np.random.default_rng(sum(bounds) + 10)
    people = [("k", {"id": i, "name": f"n{i}", "ts": int(t)})
              for i, t in enumerate(rng.integers(100, 130, 40))]  # fmt: skip
    auctions = [("k", {"id": 100 + i, "name": "", "ts": int(t)})
                for i, t in enumerate(rng.integers(100, 130, 40))]  # fmt: skip
    pick = fields(left={"l": "id", "lt": "ts"}, right={"r": "id", "rt": "ts"})
    join = IntervalJoin("ts", "ts", between=bounds, select=pick)
    by_dicts = IntervalJoin("ts", "ts", between=bounds, select=lambda a, b: pick(a, b))
    want = pairs_in_order(by_dicts, people, auctions, column_wise=False)
    assert len(want) > 10
    assert pairs_in_order(join, people, auctions, column_wise=True) == want


@pytest.mark.parametrize("how", ["inner", "left", "right", "full"])
@pytest.mark.parametrize(("seed", "bounds"), [(1, (-30, 30)), (2, (0, 0)), (3, (-200, -50)),
                                              (4, (10, 400))])  # fmt: skip
def test_keys_on_columns_leave_the_state_and_output_process_leaves(
    how: str, seed: int, bounds: tuple[int, int]
) -> None:
    compare_with_process(how, seed, bounds)


def test_held_lists_read_and_written_in_python_give_the_same(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Without the extension's ``split_lists`` and ``join_lists`` the held lists are read
    and written in Python: the same output and state."""
    monkeypatch.setattr(held_module, "split_lists", lambda *args: None)
    monkeypatch.setattr(held_module, "join_lists", lambda *args: None)
    compare_with_process("full", 5, (-100, 100))


def compare_with_process(how: str, seed: int, bounds: tuple[int, int]) -> None:
    pick = fields(left={"l": "id", "k": "k", "t": "ts"}, right={"r": "id", "rk": "k", "rt": "ts"})
    seen = on_columns_against_dicts(
        lambda select: IntervalJoin("ts", "ts", between=bounds, select=select, how=how), pick, seed
    )
    assert seen.keys_as_columns > 20
