"""Enrichment with a batch deadline: unfinished inputs move to the next batch, none lost
or doubled, and the outputs equal a run without a deadline."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from microbatch.checkpoint import Layout, list_checkpoints, load_manifest
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


def test_retention_keeps_the_pending_file_a_replayed_checkpoint_still_names(
    spark, kafka_settings, admin, tmp_path: Path
) -> None:
    """A replay's copy names its source's pending file; retention must keep that file while
    a retained checkpoint names it, or every later batch built on the copy fails."""
    topic = new_topic(admin, 2)
    produce(
        kafka_settings.kafka_bootstrap_servers,
        topic,
        [click(f"u{i % 5}", f"/p{i}", ts=i) for i in range(120)],
    )
    slow = dataclasses.replace(
        enrich_pipeline(topic, str(tmp_path), deadline_s=0.2), retain_checkpoints=2
    )
    store = open_store(slow.checkpoints)

    def run(run_id: str) -> None:
        BatchRunner(spark, slow, kafka_settings).run(BatchOptions(run_id=run_id))

    def pending_of(checkpoint_id: int) -> str | None:
        ref = load_manifest(store, Layout(), checkpoint_id).metadata["enrich_pending"]
        return None if ref is None else ref["file"]

    run("b0")
    first_pending = pending_of(0)
    assert first_pending is not None
    run("b1")
    BatchRunner(None, slow, kafka_settings).replay_from(0)  # checkpoint 2, a copy of 0
    run("b3")  # retention keeps checkpoints 2 and 3; 2 still names batch 0's file
    assert pending_of(2) == first_pending and store.exists(first_pending)

    BatchRunner(None, slow, kafka_settings).replay_from(2)  # checkpoint 4, naming it too
    run("b5")  # restores the pending elements from that file

    assert list_checkpoints(store, Layout())[-1] == 5
