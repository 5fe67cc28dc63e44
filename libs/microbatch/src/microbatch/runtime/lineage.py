"""Is this checkpoint history the pipeline's own? Checked before a batch builds on it.

A checkpoint location belongs to one pipeline definition (its fingerprint: the name and
the process class) at one ``max_parallelism``; and a pipeline's first batch must not start
over sinks that already hold published batches of an earlier history, because batch ids
start at 0 again.
"""

from __future__ import annotations

from microbatch.checkpoint import Manifest
from microbatch.errors import CheckpointError
from microbatch.runtime.pipeline import Pipeline
from microbatch.settings import Settings


def check_lineage(pipeline: Pipeline, checkpoints_url: str, base: Manifest | None) -> None:
    """The newest checkpoint was written by this pipeline, at its max_parallelism."""
    if base is not None and base.pipeline_fingerprint != pipeline.fingerprint():
        raise CheckpointError(
            f"pipeline {pipeline.name!r}: checkpoint {base.checkpoint_id} in {checkpoints_url} "
            f"was written by a different pipeline definition (fingerprint "
            f"{base.pipeline_fingerprint}, now {pipeline.fingerprint()}: the name "
            "or the process class changed). A new pipeline needs a new checkpoint "
            "location and new sink locations and topics (sinks remember the batch ids "
            "they published); to keep this one, restore its definition."
        )
    if base is not None and base.max_parallelism != pipeline.max_parallelism:
        raise CheckpointError(
            f"pipeline {pipeline.name!r}: checkpoint {base.checkpoint_id} has max_parallelism "
            f"{base.max_parallelism} but the pipeline now says "
            f"{pipeline.max_parallelism}. Run `microbatch reshard` to rewrite the "
            "state for the new value, or restore the old value."
        )


def check_sinks_start_fresh(pipeline: Pipeline, settings: Settings, checkpoints_url: str) -> None:
    """Before a pipeline's first batch: no sink already holds published batches.
    Batch ids start at 0 again with a new checkpoint location, and a sink with history
    would skip (Kafka: its publish marker) or overwrite (Parquet: its commits) them."""
    for sink in pipeline.all_sinks():
        last = sink.last_published(settings, pipeline.name)
        if last is not None:
            raise CheckpointError(
                f"pipeline {pipeline.name!r} has no checkpoint in {checkpoints_url}, but its "
                f"sink {sink.name!r} already published batches up to {last} (an earlier "
                "checkpoint location, or one that was deleted). Starting over would "
                "reuse those batch ids: point the sink to a new location or topic, or "
                "restore the pipeline's checkpoints."
            )
