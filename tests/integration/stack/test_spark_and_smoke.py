"""Spark runs Python workers from this venv, and the smoke job goes Kafka → Spark → S3."""

from __future__ import annotations

import sys
import uuid

import pyarrow as pa
import pytest

from microbatch.smoke import run_smoke

pytestmark = pytest.mark.integration


def test_map_in_arrow_runs_python_workers_with_this_interpreter(spark):
    def tag(batches):
        import sys as worker_sys

        for batch in batches:
            n = batch.num_rows
            yield pa.RecordBatch.from_pydict(
                {
                    "id": batch.column("id"),
                    "double": pa.compute.multiply(batch.column("id"), 2),
                    "python": [worker_sys.executable] * n,
                }
            )

    rows = (
        spark.range(0, 1000, numPartitions=4)
        .mapInArrow(tag, "id long, double long, python string")
        .collect()
    )

    assert sorted(r["double"] for r in rows) == [2 * i for i in range(1000)]
    assert {r["python"] for r in rows} == {sys.executable}


def test_smoke_job_writes_every_produced_event_to_parquet_on_s3(stack_settings, spark):
    run_id = uuid.uuid4().hex[:8]

    result = run_smoke(
        stack_settings, topic=f"smoke-{run_id}", events=2_000, run_id=run_id, spark=spark
    )

    assert result.produced == 2_000
    assert result.records_read == 2_000
    assert result.rows_in_parquet == 2_000
    assert len(result.files) == result.partitions == 3


def test_smoke_rerun_rewrites_the_same_files_with_the_same_rows(stack_settings, spark):
    run_id = uuid.uuid4().hex[:8]
    first = run_smoke(
        stack_settings, topic=f"smoke-{run_id}", events=500, run_id=run_id, spark=spark
    )

    again = run_smoke(
        stack_settings,
        topic=f"smoke-{run_id}",
        events=0,
        run_id=run_id,
        produce=False,
        spark=spark,
    )

    assert again.files == first.files
    assert again.rows_in_parquet == first.rows_in_parquet == 500
