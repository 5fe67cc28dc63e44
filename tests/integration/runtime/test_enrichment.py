"""Enrichment with a batch deadline: unfinished inputs move to the next batch, none lost
or doubled, and the outputs equal a run without a deadline."""

from __future__ import annotations

from pathlib import Path

import pytest

from microbatch.checkpoint import Layout, load_manifest
from microbatch.runtime import BatchOptions, BatchRunner
from microbatch.sinks import read_parquet_sink
from microbatch.storage import open_store
from tests.integration.runtime.pipelines import click, enrich_pipeline
from tests.integration.runtime.test_batches import new_topic, produce

pytestmark = pytest.mark.integration


def rows(root: Path) -> list[dict]:
    table = read_parquet_sink(str(root / "tags")).to_pylist()
    return sorted(table, key=lambda r: (r["user"], r["ts"]))


def test_a_batch_deadline_carries_unfinished_enrichment_to_the_next_batch(
    spark, kafka_settings, admin, tmp_path: Path
) -> None:
    topic = new_topic(admin, 2)
    values = [click(f"u{i % 5}", f"/p{i}", ts=i) for i in range(120)]
    produce(kafka_settings.kafka_bootstrap_servers, topic, values)

    # capacity 4 x 20 ms → ~200 elements/s per task; 0.2 s cannot finish 60 per task.
    slow = enrich_pipeline(topic, str(tmp_path / "deadline"), deadline_s=0.2)
    first = BatchRunner(spark, slow, kafka_settings).run(BatchOptions(run_id="a"))
    store = open_store(slow.checkpoints)
    pending = load_manifest(store, Layout(), 0).metadata["enrich_pending"]
    assert first.records_in == 120 and pending is not None and 0 < pending["count"] < 120
    done = sum(first.outputs.values())
    assert done + pending["count"] == 120

    batches = 1
    while load_manifest(store, Layout(), batches - 1).metadata["enrich_pending"]:
        BatchRunner(spark, slow, kafka_settings).run(BatchOptions(run_id=f"b{batches}"))
        batches += 1
        assert batches < 30, "pending enrichment never drained"

    ref = enrich_pipeline(topic, str(tmp_path / "ref"), deadline_s=None)
    BatchRunner(spark, ref, kafka_settings).run(BatchOptions(run_id="r"))
    got, want = rows(tmp_path / "deadline"), rows(tmp_path / "ref")
    assert len(want) == 120
    assert got == want
