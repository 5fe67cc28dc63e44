"""An inner interval join with ``select=fields(...)`` and both times read from fields
takes the keys that leave nothing behind at once, on columns: their pairs found by a
range search with numpy, in the order ``process`` emits them. Batch by batch, through a
crash and a rescale, with records late and records held across batches (whose keys go
to ``process``), its output and dead letters equal the same join of dicts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

from microbatch.joins import IntervalJoin, fields
from microbatch.keygroups import KeyGroupRange, encode_key
from microbatch.runtime import KafkaSource, ParquetSink
from microbatch.runtime.process import Handled, KeyedBatch
from microbatch.runtime.side_columns import RecordsOnUse, SideColumns
from microbatch.state.backend import KeyedStateBackend
from microbatch.state.codec import encode_values
from microbatch.testing import ProcessHarness, sided
from tests.unit.dataflow.test_joins_at_once import two_topics
from tests.unit.joins.test_window_columns import produce_alike, run_batches
from tests.unit.runtime.test_window_pre_aggregation import dead_letters

PICK = fields(left={"person": "id", "name": "name", "at": "ts"}, right={"sold_at": "ts"})


def run(root: Path, column_wise: bool) -> tuple[list, list, Any]:
    log, flow = two_topics("sold-by", ("people", "auctions"), 2, root)
    people = flow.source(KafkaSource(topics=("people",)))
    auctions = flow.source(KafkaSource(topics=("auctions",)))
    select = PICK if column_wise else (lambda p, a: PICK(p, a))
    join = IntervalJoin("ts", "ts", between=("-2s", "1s"), select=select)
    people.key_by("id").join(auctions.key_by("seller"), join, uid="sold-by").to(
        ParquetSink("out", str(root / "out"))
    )
    out, counters = run_batches(flow.build(), log, root / "out", produce_alike, column_wise)
    return out, dead_letters(root / "dead"), counters


def test_an_inner_interval_join_on_columns_gives_what_the_join_of_dicts_gives(
    tmp_path: Path,
) -> None:
    want_out, want_dead, want_counts = run(tmp_path / "dicts", column_wise=False)
    got_out, got_dead, got_counts = run(tmp_path / "columns", column_wise=True)

    assert got_out == want_out
    assert got_dead == want_dead
    assert all(len(batch) > 20 for batch in want_out), [len(b) for b in want_out]
    assert any(d[0] == "late_join" for d in want_dead)
    columns = sum(v for k, v in got_counts.items() if k.endswith("keys_as_columns"))
    keys = sum(v for k, v in got_counts.items() if k.endswith(".keys") or k == "keys")
    assert 0 < columns < keys, got_counts  # some keys wait in state: those go to process
    assert not any(k.endswith("keys_as_columns") for k in want_counts)


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


def test_a_key_whose_record_can_still_pair_after_the_batch_is_left_to_process() -> None:
    join = IntervalJoin("ts", "ts", between=(-2, 1), select=fields(left=["ts"], right={"r": "ts"}))
    person = [
        ("k", {"ts": 100})
    ]  # pairs with auctions up to 101: held until the watermark passes 101
    at_101 = on_columns(join, person, [], watermark=101)
    assert at_101 is not None and not at_101.keys.any()
    at_102 = on_columns(join, person, [], watermark=102)
    assert at_102 is not None and at_102.keys.all() and at_102.columns.num_rows == 0


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
