"""Parquet output of rewound batches is replaced atomically, never hidden early or doubled."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow as pa

from microbatch.sinks import parquet as ps
from microbatch.storage import open_store
from microbatch.storage.counting import CountingStore


class Lineage:
    """What the batch runner does around a Parquet sink: each checkpoint records what its
    batch supersedes and hands the still-awaiting batches on to the next one."""

    def __init__(self, store: Any) -> None:
        self.store = store
        self.awaiting: ps.Awaiting = {}

    def batch(self, batch_id: int, rows: list[int], ends: dict[str, int]) -> None:
        staged = ps.stage_parquet(self.store, "out", batch_id, 0, pa.table({"n": rows}))
        supersedes, self.awaiting = ps.after_batch(self.awaiting, ends)
        ps.publish_parquet(self.store, batch_id, [staged] if staged else [], ends, supersedes)

    def rewind(self, batch_id: int, undone: list[int]) -> None:
        self.awaiting = ps.awaiting_replacement(self.store, undone)
        ps.publish_rewind(self.store, batch_id, undone)


def visible(tmp_path: Path) -> list[int]:
    return sorted(ps.read_parquet_sink(str(tmp_path)).column("n").to_pylist())


def test_a_rewind_keeps_old_output_until_each_batch_is_recomputed(tmp_path: Path) -> None:
    sink = Lineage(open_store(str(tmp_path)))
    sink.batch(0, [1], {"t/0": 10})
    sink.batch(1, [2], {"t/0": 20})
    sink.batch(2, [3], {"t/0": 30})
    sink.rewind(3, [1, 2])  # back to checkpoint 0
    assert visible(tmp_path) == [1, 2, 3]  # nothing recomputed yet: nothing hidden
    sink.batch(4, [20], {"t/0": 20})  # recomputes batch 1's input
    assert visible(tmp_path) == [1, 3, 20]
    sink.batch(5, [30], {"t/0": 30})
    assert visible(tmp_path) == [1, 20, 30]
    assert sink.awaiting == {}


def test_a_batch_that_reads_further_replaces_every_undone_batch_it_covers(tmp_path) -> None:
    sink = Lineage(open_store(str(tmp_path)))
    sink.batch(0, [1], {"t/0": 10, "t/1": 5})
    sink.batch(1, [2], {"t/0": 20, "t/1": 5})
    sink.rewind(2, [0, 1])
    sink.batch(3, [11], {"t/0": 10, "t/1": 4})  # not all of batch 0's input yet
    assert visible(tmp_path) == [1, 2, 11]
    sink.batch(4, [22], {"t/0": 25, "t/1": 5})
    assert visible(tmp_path) == [11, 22]


def test_a_second_rewind_keeps_what_the_first_left_visible(tmp_path: Path) -> None:
    sink = Lineage(open_store(str(tmp_path)))
    for b, end in enumerate((10, 20, 30)):
        sink.batch(b, [b], {"t/0": end})
    sink.rewind(3, [1, 2])  # back to checkpoint 0
    sink.batch(4, [41], {"t/0": 20})  # replaces batch 1; batch 2 still awaits
    sink.rewind(5, [4])  # back to checkpoint 0 again: batch 4's output awaits too
    assert visible(tmp_path) == [0, 2, 41]
    assert sorted(sink.awaiting) == ["2", "4"]
    sink.batch(6, [61], {"t/0": 30})
    assert visible(tmp_path) == [0, 61]


def test_publishing_again_after_a_crash_changes_nothing(tmp_path: Path) -> None:
    store = open_store(str(tmp_path))
    sink = Lineage(store)
    sink.batch(0, [1], {"t/0": 10})
    sink.rewind(1, [0])
    assert ps.publish_rewind(store, 1, [0]) is False
    sink.batch(2, [5], {"t/0": 10})
    staged = ps.stage_parquet(store, "out", 2, 0, pa.table({"n": [5]}))
    assert ps.publish_parquet(store, 2, [staged], {"t/0": 10}, [0]) is False
    assert visible(tmp_path) == [5]


def test_publishing_a_batch_reads_no_commit_entries_however_many_there_are(tmp_path) -> None:
    """Only a rewind lists and reads ``_commits``; a batch's publish costs the same after
    ten batches or ten thousand."""
    store = CountingStore(open_store(str(tmp_path)))
    sink = Lineage(store)
    per_batch = []
    for b in range(30):
        store.reset()
        sink.batch(b, [b], {"t/0": b + 1})
        per_batch.append(dict(store.requests))
    assert per_batch[-1] == per_batch[0] == {"put": 1, "exists": 1, "create": 1}
