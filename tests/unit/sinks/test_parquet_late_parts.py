"""A stalled attempt that stages a Parquet part after its batch left retention leaves no
part behind: retention deletes the batch's plan before it collects the batch's orphans,
and staging looks for the plan after writing, so one of the two always sees the other."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pytest

from microbatch.checkpoint import Layout
from microbatch.errors import SinkError
from microbatch.settings import Settings
from microbatch.sinks import ParquetSink
from microbatch.sinks import parquet as ps
from microbatch.sinks.base import StageContext
from microbatch.storage import open_store

ROWS = pa.table({"user": ["u1", "u2"], "clicks": [1, 2]})


def context(tmp_path: Path, attempt: str) -> StageContext:
    checkpoints = open_store(str(tmp_path / "checkpoints"))
    return StageContext("counts", 7, 0, Settings(), checkpoints, Layout(), attempt)


def test_a_part_staged_while_the_batch_has_its_plan_stays(tmp_path: Path) -> None:
    ctx = context(tmp_path, "a1")
    ctx.checkpoint_store.put(ctx.layout.plan_key(7), b"{}")
    staged = ParquetSink("counts", str(tmp_path / "out")).stage_table(ctx, ROWS)
    assert staged is not None and open_store(str(tmp_path / "out")).exists(staged.file)


def test_a_part_staged_after_retention_collected_its_batch_is_deleted(tmp_path: Path) -> None:
    out = open_store(str(tmp_path / "out"))
    winner = context(tmp_path, "winner")
    winner.checkpoint_store.put(winner.layout.plan_key(7), b"{}")
    won = ParquetSink("counts", str(tmp_path / "out")).stage_table(winner, ROWS)
    assert won is not None
    ps.publish_parquet(out, 7, [won], {}, (), "counts")
    # Batch 7 leaves retention: its plan goes first, then its orphans are collected.
    winner.checkpoint_store.delete(winner.layout.plan_key(7))
    assert ps.collect_orphans(out, [7]) == 0
    # A zombie attempt of batch 7 wakes and stages now: nothing would ever collect it.
    with pytest.raises(SinkError, match="batch 7 sink 'counts': the batch left retention"):
        ParquetSink("counts", str(tmp_path / "out")).stage_table(context(tmp_path, "zombie"), ROWS)
    assert list(out.list(ps.batch_prefix(7))) == [won.file]
