"""The Iceberg sink's table as another Iceberg implementation reads it: batches staged and
published through the sink protocol (a partitioned table, a rerun, a rewind and a backfill
replacing one batch, a new nullable column), then read by Apache Iceberg's Java reader in
one short-lived JVM. Its rows equal pyiceberg's scan, and its snapshots are exactly one per
batch, each naming the batch."""

from __future__ import annotations

import datetime
import json
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pytest

from microbatch.checkpoint import Layout
from microbatch.settings import Settings
from microbatch.sinks import IcebergCatalog, IcebergSink, PublishContext, StageContext
from microbatch.sinks.iceberg import read_iceberg_sink
from microbatch.storage import open_store
from tests.integration.sinks.spark_iceberg import java_read_iceberg

pytestmark = pytest.mark.integration

SCHEMA = pa.schema([("user", pa.string()), ("clicks", pa.int64()), ("day", pa.date32())])
WIDER = pa.schema([*SCHEMA, pa.field("score", pa.float64())])
DAY = datetime.date(2026, 11, 25)


@pytest.fixture(autouse=True, scope="module")
def _pyiceberg_threads() -> Iterator[None]:
    """Stop pyiceberg's process-wide thread pool (non-daemon workers) after the module."""
    from pyiceberg.utils.concurrent import ExecutorFactory

    yield
    if ExecutorFactory._instance is not None:
        ExecutorFactory._instance.shutdown(wait=True)
        ExecutorFactory._instance = None


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
