"""The Delta sink through the real runtime, on SeaweedFS S3, real Kafka and real Spark.

A crash at each point around the sink (staged, committed, half published), rerun at another
parallelism, leaves the table equal to a clean run's, with exactly one data commit per batch
carrying the batch's app transaction. A backfill run twice replaces each interval in one
version and gives exactly the reference rows, as delta-rs and Spark's own Delta reader see
them. A foreign writer's commits are kept and retried over.
"""

from __future__ import annotations

import collections
import json
import uuid
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from microbatch.runtime import BatchOptions, BatchRunner, KafkaSource, Pipeline
from microbatch.settings import Settings
from microbatch.sinks import DeltaSink, read_delta_sink
from microbatch.sinks.delta import DeltaTarget, storage_options, table_location
from microbatch.storage import open_store
from tests.integration.runtime.pipelines import COUNT_SCHEMA, CountClicks
from tests.integration.runtime.test_backfill import expected_rows, interval, topic  # noqa: F401
from tests.integration.runtime.test_batches import clicks, new_topic, produce
from tests.integration.sinks.spark_delta import copy_table, spark_read_delta

pytestmark = pytest.mark.integration

CLICKS = 120  # three batches of at most 50


def delta_pipeline(source: str, root: Path, table: str, max_records: int | None = 50) -> Pipeline:
    return Pipeline(
        name="counts",
        source=KafkaSource(topics=(source,), max_records_per_batch=max_records),
        key_by="user",
        process=CountClicks(),
        sinks=[DeltaSink("counts", table, COUNT_SCHEMA)],
        checkpoints=str(root / "checkpoints"),
        max_parallelism=16,
        parallelism=2,
    )


def new_table(settings: Settings) -> str:
    return f"s3://{settings.s3_bucket}/delta-tests/{uuid.uuid4().hex[:10]}/counts"


def table_rows(table: str, settings: Settings) -> list[dict]:
    return sorted(read_delta_sink(table, settings).to_pylist(), key=json.dumps)


def log_entries(table: str, settings: Settings) -> list[dict[str, Any]]:
    """Each commit of the table's log after its creation, oldest first: its txn versions,
    adds and removes."""
    store = open_store(table, settings)
    out = []
    for key in store.list("_delta_log/"):
        if not key.endswith(".json"):
            continue
        actions = [json.loads(line) for line in store.get(key).decode().splitlines()]
        if any("protocol" in a for a in actions):  # version 0: the empty table
            assert key.endswith(f"{0:020d}.json") and not any("add" in a for a in actions)
            continue
        out.append(
            {
                "version": int(key.rsplit("/", 1)[1][:-5]),
                "txn": [a["txn"]["version"] for a in actions if "txn" in a],
                "adds": sum("add" in a for a in actions),
                "removes": sum("remove" in a for a in actions),
            }
        )
    return out


def reference(values: list[bytes]) -> dict[str, int]:
    """Plain Python: clicks per user."""
    return dict(collections.Counter(json.loads(v)["user"] for v in values))


def check_against_reference(rows: list[dict], values: list[bytes]) -> None:
    per_user = reference(values)
    assert sum(r["clicks"] for r in rows) == len(values)
    for user, n in per_user.items():
        mine = [r for r in rows if r["user"] == user]
        assert sum(r["clicks"] for r in mine) == n
        assert max(r["total"] for r in mine) == n


@pytest.fixture(scope="module")
def source(stack_settings, bootstrap, admin) -> tuple[str, list[bytes]]:
    name = new_topic(admin, 3)
    values = clicks(CLICKS, seed=5)
    produce(bootstrap, name, values)
    return name, values


def run_three(spark, settings, pipe: Pipeline, crash_at: str | None) -> None:
    """Batches 0 and 1 at P=2, batch 1 crashing if asked and rerun at P=3; batch 2 at P=3."""
    BatchRunner(spark, pipe, settings).run(BatchOptions(run_id="r0"))
    if crash_at is not None:
        with pytest.raises(Exception, match="injected crash"):
            BatchRunner(spark, pipe, settings).run(BatchOptions(run_id="r1", crash_at=crash_at))
        BatchRunner(spark, pipe, settings).run(BatchOptions(run_id="r1", parallelism=3))
    else:
        BatchRunner(spark, pipe, settings).run(BatchOptions(run_id="r1"))
    BatchRunner(spark, pipe, settings).run(BatchOptions(run_id="r2", parallelism=3))


@pytest.fixture(scope="module")
def clean(spark, stack_settings, source, tmp_path_factory) -> list[dict]:
    name, values = source
    table = new_table(stack_settings)
    run_three(
        spark, stack_settings, delta_pipeline(name, tmp_path_factory.mktemp("c"), table), None
    )
    rows = table_rows(table, stack_settings)
    check_against_reference(rows, values)
    return rows


@pytest.mark.parametrize("crash_at", ["after_sink_staging", "after_commit", "during_publish"])
def test_a_crash_around_the_delta_commit_then_a_rerun_equals_the_clean_run(
    crash_at, clean, spark, stack_settings, source, tmp_path
) -> None:
    name, values = source
    table = new_table(stack_settings)
    run_three(spark, stack_settings, delta_pipeline(name, tmp_path, table), crash_at)
    rows = table_rows(table, stack_settings)
    assert rows == clean
    check_against_reference(rows, values)
    commits = log_entries(table, stack_settings)
    assert [(c["txn"], c["removes"]) for c in commits] == [([0], 0), ([1], 0), ([2], 0)]
    assert all(c["adds"] >= 1 for c in commits)
    assert DeltaSink("counts", table, COUNT_SCHEMA).last_published(stack_settings, "counts") == 2


def test_a_foreign_commit_between_our_batches_and_after_our_snapshot_is_retried(
    spark, stack_settings, bootstrap, admin, tmp_path
) -> None:
    from deltalake import write_deltalake

    name, table = new_topic(admin, 2), new_table(stack_settings)
    pipe = delta_pipeline(name, tmp_path, table, max_records=None)
    first, second = clicks(20, seed=1), clicks(10, seed=2)
    produce(bootstrap, name, first)
    BatchRunner(spark, pipe, stack_settings).run(BatchOptions(run_id="a"))
    foreign = pa.Table.from_pylist([{"user": "foreign", "clicks": 0, "total": 0}], COUNT_SCHEMA)
    opts = storage_options(table, stack_settings)
    write_deltalake(table_location(table), foreign, mode="append", storage_options=opts)
    produce(bootstrap, name, second)
    BatchRunner(spark, pipe, stack_settings).run(BatchOptions(run_id="b"))
    rows = table_rows(table, stack_settings)
    assert {"user": "foreign", "clicks": 0, "total": 0} in rows
    check_against_reference([r for r in rows if r["user"] != "foreign"], first + second)
    assert [c["txn"] for c in log_entries(table, stack_settings)] == [[0], [], [1]]

    # On S3 too: a snapshot read before another writer's commit retries on the new version,
    # and a second publish of the same batch from that stale snapshot commits nothing.
    target = DeltaTarget(pipe.sinks[0], "counts", stack_settings)  # type: ignore[arg-type]
    stale = target.load()
    write_deltalake(table_location(table), foreign, mode="append", storage_options=opts)
    extra = pa.Table.from_pylist([{"user": "late", "clicks": 1, "total": 1}], COUNT_SCHEMA)
    files = target.write_files(extra, 9, 0, "s3test")
    assert target.publish(9, files, snapshot=stale)
    assert not target.publish(9, files, snapshot=stale)
    entries = log_entries(table, stack_settings)
    assert [c["txn"] for c in entries] == [[0], [], [1], [], [9]]


def test_a_twice_run_backfill_replaces_each_interval_in_one_version(
    spark,
    stack_settings,
    topic,  # noqa: F811 (the fixture of test_backfill)
    tmp_path,
) -> None:
    name, sent = topic
    table = new_table(stack_settings)
    pipe = delta_pipeline(name, tmp_path, table, max_records=None)

    def run(i: int, backfill: bool = False) -> Any:
        start, end = interval(i)
        run_id = f"i{i}-{uuid.uuid4().hex[:6]}"
        options = BatchOptions(interval_start_ms=start, until_timestamp_ms=end,
                               backfill=backfill, run_id=run_id)  # fmt: skip
        return BatchRunner(spark, pipe, stack_settings).run(options)

    for i in range(4):
        run(i)
    assert table_rows(table, stack_settings) == expected_rows(sent)
    for _ in range(2):
        before = len(log_entries(table, stack_settings))
        first = run(2, backfill=True)
        assert first.rewind is not None
        rewind_id = first.rewind["checkpoint"]
        assert table_rows(table, stack_settings) == expected_rows(sent)  # I2 replaced only
        run(3, backfill=True)
        assert table_rows(table, stack_settings) == expected_rows(sent)
        new = log_entries(table, stack_settings)[before:]
        # The rewind's version (no data), then one version per recomputed interval that
        # adds its files and removes the old interval's, with the batch's txn.
        assert [(c["txn"], c["adds"] > 0, c["removes"] > 0) for c in new] == [
            ([rewind_id], False, False),
            ([first.batch_id], True, True),
            ([first.batch_id + 1], True, True),
        ]

    # Spark's own Delta reader (delta-spark, a JVM of its own) sees the same rows and one
    # WRITE per version.
    local = copy_table(table, stack_settings, tmp_path / "copy")
    seen = spark_read_delta(local, Path(stack_settings.home_path))
    assert sorted(seen["rows"], key=json.dumps) == expected_rows(sent)
    versions = log_entries(table, stack_settings)
    assert [h["version"] for h in seen["history"]] == [0] + [c["version"] for c in versions]


def test_microbatch_optimize_compacts_each_batch_on_s3_keeping_rows_and_txn(
    spark, stack_settings, bootstrap, admin, tmp_path
) -> None:
    from microbatch.cli import build_parser, cmd_optimize

    name, table = new_topic(admin, 2), new_table(stack_settings)
    pipe = delta_pipeline(name, tmp_path, table, max_records=None)
    for n in range(2):
        produce(bootstrap, name, clicks(20, seed=n))
        BatchRunner(spark, pipe, stack_settings).run(BatchOptions(run_id=f"b{n}"))
    before, entries = table_rows(table, stack_settings), log_entries(table, stack_settings)
    assert [c["adds"] for c in entries] == [2, 2]  # one file per instance (P=2)
    job = tmp_path / "job.py"
    job.write_text(
        "from pathlib import Path\n"
        "from tests.integration.sinks.test_delta_sink import delta_pipeline\n"
        f"pipeline = delta_pipeline({name!r}, Path({str(tmp_path)!r}), {table!r}, None)\n"
    )
    argv = ["optimize", str(job), "--sink", "counts", "--vacuum", "--retention-hours", "1"]
    out = cmd_optimize(build_parser().parse_args(argv), stack_settings)
    assert (out["batches"], out["files_before"], out["files_after"]) == (2, 4, 2)
    assert out["vacuumed"] == []  # nothing is an hour old
    assert table_rows(table, stack_settings) == before
    last = log_entries(table, stack_settings)[-1]
    assert (last["txn"], last["adds"], last["removes"]) == ([], 2, 4)
    assert DeltaSink("counts", table, COUNT_SCHEMA).last_published(stack_settings, "counts") == 1
