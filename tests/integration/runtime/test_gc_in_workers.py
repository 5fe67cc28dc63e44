"""A Spark Python worker freezes its long-lived objects once, at its first task's start,
so PySpark's full collection after every task no longer walks them."""

from __future__ import annotations

from collections.abc import Iterator

import pyarrow as pa


def freeze_and_report(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    import gc
    import os

    from microbatch import gcpause

    gcpause.freeze_in_spark_worker()
    frozen = gc.get_freeze_count()
    again: list[bool] = []
    freeze, gc.freeze = gc.freeze, lambda: again.append(True)
    try:
        gcpause.freeze_in_spark_worker()  # as a later task of the same worker would
    finally:
        gc.freeze = freeze
    list(batches)
    yield pa.RecordBatch.from_pydict(
        {"pid": [os.getpid()], "frozen": [frozen], "again": [bool(again)],
         "flag": [gcpause._frozen]}
    )  # fmt: skip


def test_a_task_freezes_what_its_worker_had_imported_and_only_once(spark) -> None:
    rows = (
        spark.range(0, 2, 1, 2)
        .mapInArrow(freeze_and_report, "pid long, frozen long, again boolean, flag boolean")
        .collect()
    )

    assert len(rows) == 2
    for row in rows:
        assert row["flag"] is True
        assert row["frozen"] > 10_000, f"worker {row['pid']} froze only {row['frozen']} objects"
        assert row["again"] is False, f"worker {row['pid']} froze a second time"
