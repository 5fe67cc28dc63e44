"""The Iceberg sink's table as another Iceberg implementation reads it: batches staged and
published through the sink protocol (a partitioned table, a rerun, a rewind and a backfill
replacing one batch, a new nullable column; then an optimize, a backfill of a compacted
batch and an expiry), then read by Apache Iceberg's Java reader in a short-lived JVM. Its
rows equal pyiceberg's scan, and its snapshots are exactly one per batch, each naming the
batch, plus the optimize's ``replace``."""

from __future__ import annotations

import datetime
import json
import time
import uuid
from pathlib import Path

import pyarrow as pa
import pytest

from microbatch.checkpoint import Layout
from microbatch.settings import Settings
from microbatch.sinks import IcebergCatalog, IcebergSink, PublishContext, StageContext
from microbatch.sinks.iceberg import read_iceberg_sink
from microbatch.storage import open_store
from tests.integration.sinks.spark_iceberg import java_read_iceberg

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("pyiceberg_threads")]

SCHEMA = pa.schema([("user", pa.string()), ("clicks", pa.int64()), ("day", pa.date32())])
WIDER = pa.schema([*SCHEMA, pa.field("score", pa.float64())])
DAY = datetime.date(2026, 11, 25)


def run_batch(sink: IcebergSink, settings: Settings, store, batch_id: int, records: list[dict],
              ends: dict[str, int], supersedes: tuple[int, ...] = ()) -> None:  # fmt: skip
    """Stage two instances (the records split between them), then publish the batch."""
    staged = []
    for instance in (0, 1):
        ctx = StageContext("clicks", batch_id, instance, settings, store, Layout(), "a1")
        part = sink.stage(ctx, records[instance::2])
        if part is not None:
            staged.append(part)
    publish = PublishContext(
        "clicks", batch_id, settings, store, Layout(), tuple(staged), ends, supersedes
    )
    sink.publish(publish)
    sink.publish(publish)  # a rerun after a crash: nothing more


def test_iceberg_java_reads_the_sinks_table_as_pyiceberg_does(
    test_settings: Settings, tmp_path: Path
) -> None:
    catalog = IcebergCatalog.sql(f"sqlite:///{tmp_path / 'catalog.db'}", (tmp_path / "wh").as_uri())
    sink = IcebergSink("counts", "lake.clicks", SCHEMA, catalog=catalog, partition_by=("day",))
    store = open_store(str(tmp_path / "checkpoints"))
    run_batch(sink, test_settings, store, 0, [
        {"user": "a", "clicks": 1, "day": DAY}, {"user": "b", "clicks": 2, "day": None},
        {"user": "c", "clicks": 3, "day": DAY}], {"t:0": 3})  # fmt: skip
    run_batch(sink, test_settings, store, 1, [{"user": "d", "clicks": 4, "day": DAY}], {"t:0": 4})
    target = sink.target(test_settings, "clicks")
    target.publish_rewind(2, [1])
    wider = IcebergSink("counts", "lake.clicks", WIDER, catalog=catalog, partition_by=("day",))
    again = [{"user": "d", "clicks": 40, "day": DAY, "score": 0.5}]
    run_batch(wider, test_settings, store, 3, again, {"t:0": 4}, supersedes=(1,))

    seen = java_read_iceberg(
        tmp_path / "catalog.db", (tmp_path / "wh").as_uri(), catalog.name, "lake.clicks",
        test_settings.home_path,
    )  # fmt: skip
    assert seen["columns"] == ["user", "clicks", "day", "score"]
    mine = [{k: None if v is None else str(v) for k, v in r.items()}
            for r in read_iceberg_sink(wider, test_settings).to_pylist()]  # fmt: skip
    assert sorted(seen["rows"], key=json.dumps) == sorted(mine, key=json.dumps)
    assert sorted((r["user"], r["clicks"], r["score"]) for r in seen["rows"]) == [
        ("a", "1", None), ("b", "2", None), ("c", "3", None), ("d", "40", "0.5")]  # fmt: skip
    summaries = [(s["operation"], s["summary"].get("microbatch.batch"),
                  s["summary"].get("added-data-files"), s["summary"].get("deleted-data-files"))
                 for s in seen["snapshots"]]  # fmt: skip
    assert summaries == [
        ("append", "0", "2", None),  # instance 0: a, c (one day); instance 1: b (null)
        ("append", "1", "1", None),
        ("append", "2", None, None),  # the rewind: no data change
        ("overwrite", "3", "1", "1"),  # batch 3 replaces batch 1 in one snapshot
    ]
    assert all(s["summary"]["microbatch.app"] == "clicks/counts" for s in seen["snapshots"])


def test_iceberg_java_reads_the_table_after_optimize_backfill_and_expiry(
    test_settings: Settings, tmp_path: Path
) -> None:
    catalog = IcebergCatalog.sql(f"sqlite:///{tmp_path / 'catalog.db'}", (tmp_path / "wh").as_uri())
    sink = IcebergSink("counts", "lake.clicks", SCHEMA, catalog=catalog, partition_by=("day",))
    store = open_store(str(tmp_path / "checkpoints"))

    def clicks(b: int) -> list[dict]:  # two instances x two days: four files a batch
        return [{"user": f"u{b}{i}", "clicks": 10 * b + i, "day": DAY if i < 2 else None}
                for i in range(4)]  # fmt: skip

    run_batch(sink, test_settings, store, 0, clicks(0), {"t:0": 4})
    run_batch(sink, test_settings, store, 1, clicks(1), {"t:0": 8})
    target = sink.target(test_settings, "clicks")
    originals = {task.file.file_path for task in target.load().scan().plan_files()}
    cut = target.load().current_snapshot().timestamp_ms + 1
    while time.time() * 1000 <= cut:  # all that follows is younger than the cut
        pass
    done = target.optimize()
    assert (done["batches"], done["files_before"], done["files_after"]) == (2, 8, 4)
    target.publish_rewind(2, [1])
    again = [{"user": "u10", "clicks": 99, "day": DAY}]
    run_batch(sink, test_settings, store, 3, again, {"t:0": 8}, supersedes=(1,))
    target.clock = lambda: cut / 1000 + 3600  # the cut is one hour old
    gone = target.vacuum(1)
    assert originals <= set(gone)  # merged away, and only expired snapshots read them
    run_batch(sink, test_settings, store, 3, again, {"t:0": 8}, supersedes=(1,))  # a retry

    seen = java_read_iceberg(
        tmp_path / "catalog.db", (tmp_path / "wh").as_uri(), catalog.name, "lake.clicks",
        test_settings.home_path,
    )  # fmt: skip
    mine = [{k: None if v is None else str(v) for k, v in r.items()}
            for r in read_iceberg_sink(sink, test_settings).to_pylist()]  # fmt: skip
    assert sorted(seen["rows"], key=json.dumps) == sorted(mine, key=json.dumps)
    assert sorted((r["user"], r["clicks"]) for r in seen["rows"]) == [
        ("u00", "0"), ("u01", "1"), ("u02", "2"), ("u03", "3"), ("u10", "99")]  # fmt: skip
    summaries = [(s["operation"], s["summary"].get("microbatch.batch"),
                  s["summary"].get("added-data-files"), s["summary"].get("deleted-data-files"))
                 for s in seen["snapshots"]]  # fmt: skip
    assert summaries == [
        ("replace", None, "4", "8"),  # batches 0 and 1 compacted; their snapshots expired
        ("append", "2", None, None),  # the rewind
        ("overwrite", "3", "1", "2"),  # batch 3 replaces batch 1's two merged files
    ]


def test_optimize_and_vacuum_on_s3_keep_the_rows_and_delete_only_unread_files(
    s3_settings: Settings, tmp_path: Path
) -> None:
    warehouse = f"s3://{s3_settings.s3_bucket}/iceberg-tests/{uuid.uuid4().hex[:10]}"
    catalog = IcebergCatalog.sql(f"sqlite:///{tmp_path / 'catalog.db'}", warehouse)
    sink = IcebergSink("counts", "lake.clicks", SCHEMA, catalog=catalog, partition_by=("day",))
    store = open_store(str(tmp_path / "checkpoints"))
    for b in (0, 1):
        records = [{"user": f"u{b}{i}", "clicks": i, "day": DAY} for i in range(4)]
        run_batch(sink, s3_settings, store, b, records, {"t:0": 4 * (b + 1)})
    target = sink.target(s3_settings, "clicks")
    originals = {task.file.file_path for task in target.load().scan().plan_files()}
    before = sorted(read_iceberg_sink(sink, s3_settings).to_pylist(), key=str)
    assert target.optimize()["files_after"] == 2
    assert target.vacuum(1) == []  # everything is younger than an hour
    target.clock = lambda: time.time() + 2 * 3600
    gone = target.vacuum(1)
    assert originals <= set(gone) and all(p.startswith(warehouse) for p in gone)
    assert sorted(read_iceberg_sink(sink, s3_settings).to_pylist(), key=str) == before
    left = set(open_store(warehouse, s3_settings).list("lake/clicks/data/"))
    assert len(left) == 2 and all("-merged-" in key for key in left)
