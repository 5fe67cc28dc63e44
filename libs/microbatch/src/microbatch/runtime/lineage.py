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
    dropped_steps(pipeline, base)


def dropped_steps(pipeline: Pipeline, base: Manifest | None) -> set[str]:
    """The further keyed steps of ``base`` whose state this batch drops, as the pipeline's
    ``drop_state`` allows: steps no longer in the dataflow, or whose function changed
    class. Without the allowance either is refused, and so is a renamed first step."""
    if base is None:
        return set()
    where = f"pipeline {pipeline.name!r}: checkpoint {base.checkpoint_id}"
    if base.first_uid is not None and pipeline.uid is not None and base.first_uid != pipeline.uid:
        raise CheckpointError(
            f"{where} holds the state of first keyed step {base.first_uid!r}, but the "
            f"dataflow's first keyed step is now {pipeline.uid!r}. A uid names the step's "
            f"state: restore uid={base.first_uid!r} (renaming it is not supported)."
        )
    types = pipeline.step_types()
    allowed = set(pipeline.drop_state)
    gone = [u for u in base.operators if u not in types]
    changed = [
        u
        for u, op in base.operators.items()
        if u in types and op.process and op.process != types[u]
    ]
    refused_gone = [u for u in gone if u not in allowed]
    if refused_gone:
        new = [u for u in types if u not in base.operators]
        hint = f" (new steps: {', '.join(map(repr, new))}: a renamed uid?)" if new else ""
        raise CheckpointError(
            f"{where} holds the state of keyed step(s) {', '.join(map(repr, refused_gone))}, "
            f"which the dataflow no longer has{hint}. Restore the step or its uid; to drop "
            f"its state for good, set drop_state={tuple(refused_gone)!r}."
        )
    refused_changed = [u for u in changed if u not in allowed]
    if refused_changed:
        u = refused_changed[0]
        raise CheckpointError(
            f"{where}: keyed step {u!r} ran {base.operators[u].process} and now runs "
            f"{types[u]}; its state was written by the old function. Restore it, or set "
            f"drop_state=({u!r},) to start the step with empty state."
        )
    return set(gone) | set(changed)


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
