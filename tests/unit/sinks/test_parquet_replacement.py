"""Parquet output of rewound batches is replaced atomically, never hidden early or doubled."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa

from microbatch.sinks import parquet as ps
from microbatch.storage import open_store


def publish(store, batch_id: int, rows: list[int], ends: dict[str, int]) -> None:
    staged = ps.stage_parquet(store, "out", batch_id, 0, pa.table({"n": rows}))
    ps.publish_parquet(store, batch_id, [staged] if staged else [], ends)


def visible(tmp_path: Path) -> list[int]:
    return sorted(ps.read_parquet_sink(str(tmp_path)).column("n").to_pylist())


def test_a_rewind_keeps_old_output_until_each_batch_is_recomputed(tmp_path: Path) -> None:
    store = open_store(str(tmp_path))
    publish(store, 0, [1], {"t/0": 10})
    publish(store, 1, [2], {"t/0": 20})
    publish(store, 2, [3], {"t/0": 30})
    ps.publish_rewind(store, 3, [1, 2])  # back to checkpoint 0
    assert visible(tmp_path) == [1, 2, 3]  # nothing recomputed yet: nothing hidden
    publish(store, 4, [20], {"t/0": 20})  # recomputes batch 1's input
    assert visible(tmp_path) == [1, 3, 20]
    publish(store, 5, [30], {"t/0": 30})
    assert visible(tmp_path) == [1, 20, 30]


def test_a_batch_that_reads_further_replaces_every_undone_batch_it_covers(tmp_path) -> None:
    store = open_store(str(tmp_path))
    publish(store, 0, [1], {"t/0": 10, "t/1": 5})
    publish(store, 1, [2], {"t/0": 20, "t/1": 5})
    ps.publish_rewind(store, 2, [0, 1])
    publish(store, 3, [11], {"t/0": 10, "t/1": 4})  # not all of batch 0's input yet
    assert visible(tmp_path) == [1, 2, 11]
    publish(store, 4, [22], {"t/0": 25, "t/1": 5})
    assert visible(tmp_path) == [11, 22]


def test_publishing_again_after_a_crash_changes_nothing(tmp_path: Path) -> None:
    store = open_store(str(tmp_path))
    publish(store, 0, [1], {"t/0": 10})
    ps.publish_rewind(store, 1, [0])
    assert ps.publish_rewind(store, 1, [0]) is False
    publish(store, 2, [5], {"t/0": 10})
    staged = ps.stage_parquet(store, "out", 2, 0, pa.table({"n": [5]}))
    assert ps.publish_parquet(store, 2, [staged], {"t/0": 10}) is False
    assert visible(tmp_path) == [5]
