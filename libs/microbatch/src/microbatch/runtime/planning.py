"""Step 2 of the protocol: the offset ranges of the next batch — stored, replayed, or
re-planned when Kafka deleted what a stored plan was to read.

A batch's plan is stored before any work, and every attempt of the batch replays it, so a
rerun reads the same records — only a run of the pipeline that stored it: another
pipeline's plan (two pipelines given one checkpoint location) stops the run before any
work. A stored plan can outlive its records: a crash, then topic
retention deleting the start of a planned range before the rerun. Replaying it would fail
every attempt, forever. So a replay first checks the plan's ranges against the earliest
kept offsets; when some are gone the batch is **re-planned** from the committed offsets,
skipping exactly what was deleted (recorded per partition in the plan's ``skipped``, and
from there in the checkpoint's stats), if the source says ``on_out_of_range="earliest"``
or the run asks for it (``microbatch run --replan``). Otherwise the run fails, naming the
lost offsets and both ways on. The batch has not committed (the run holds the lease and
the checkpoint is the one before it), so replacing its plan changes nothing anyone used.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Mapping

from microbatch.errors import ConfigError, DataLossError
from microbatch.kafka import (
    BatchLimits,
    BatchPlan,
    BrokerView,
    PlanStore,
    StartingPosition,
    TopicPartition,
    plan_batch,
)
from microbatch.runtime.options import BatchOptions
from microbatch.runtime.pipeline import OnOutOfRange, Pipeline

log = logging.getLogger(__name__)


def next_plan(
    plans: PlanStore,
    broker: BrokerView,
    pipeline: Pipeline,
    committed: Mapping[TopicPartition, int] | None,
    batch_id: int,
    options: BatchOptions,
) -> tuple[BatchPlan, bool]:
    """(plan, replayed): the stored plan of ``batch_id``, a new one, or a re-plan."""
    stored = plans.load(batch_id)
    if stored is not None:
        check_plan_is_ours(plans, pipeline, stored)
    if stored is None:
        plan = plans.save(_plan(broker, pipeline, committed, batch_id, options))
        plans.check_continues(plan, committed)
        return plan, False
    plans.check_continues(stored, committed)
    lost = lost_ranges(stored, broker)
    if not lost:
        return stored, True
    where = f"pipeline {pipeline.name!r} batch {batch_id}"
    listed = ", ".join(f"{tp} [{start}, {kept})" for tp, (start, kept) in sorted(lost.items()))
    if not (options.replan or pipeline.source.on_out_of_range == "earliest"):
        raise DataLossError(
            f"{where}: Kafka deleted records its stored plan was to read before the batch "
            f"ran ({listed}: offsets before the earliest kept one). Every rerun of this plan "
            "would fail. To go on without them, rerun with `microbatch run --replan` (the "
            "batch is planned again from the last checkpoint and the lost offsets are "
            "recorded in its stats as skipped), or set on_out_of_range='earliest'."
        )
    log.warning("%s: re-planned; retention deleted %s before the batch ran", where, listed)
    plan = _plan(broker, pipeline, committed, batch_id, options, on_out_of_range="earliest")
    # The loss, counted from where the stored plan started (also for a partition without a
    # committed offset, whose new start the planner does not count as a skip).
    skipped = dict(plan.skipped)
    for tp, (start, _kept) in lost.items():
        skipped[tp] = max(skipped.get(tp, 0), plan.start_offsets.get(tp, start) - start)
    plan = dataclasses.replace(plan, skipped=skipped)
    plans.replace(plan)
    return plan, False


def check_plan_is_ours(plans: PlanStore, pipeline: Pipeline, stored: BatchPlan) -> None:
    """A stored plan replays only for the pipeline that wrote it. Another pipeline's plan
    means two pipelines share one checkpoint location: replaying it would read the other's
    topics and commit them as this pipeline's batch, so the run stops before any work."""
    if stored.pipeline == pipeline.name:
        return
    raise ConfigError(
        f"pipeline {pipeline.name!r}: the checkpoint location {plans.store.url} holds the plan "
        f"of batch {stored.batch_id} of pipeline {stored.pipeline!r} "
        f"({plans.key(stored.batch_id)}): two pipelines share this location, and this run "
        f"would replay the other one's plan. This run did no work. Give {pipeline.name!r} "
        f"(or {stored.pipeline!r}) a checkpoint location of its own, and sink locations of "
        "its own too."
    )


def lost_ranges(plan: BatchPlan, broker: BrokerView) -> dict[TopicPartition, tuple[int, int]]:
    """Ranges of ``plan`` whose start Kafka no longer has: tp → (start, earliest kept)."""
    if not plan.ranges:
        return {}
    earliest = broker.beginning_offsets([TopicPartition(r.topic, r.partition) for r in plan.ranges])
    out = {}
    for r in plan.ranges:
        kept = earliest.get(TopicPartition(r.topic, r.partition), 0)
        if kept > r.start:
            out[TopicPartition(r.topic, r.partition)] = (r.start, kept)
    return out


def _plan(
    broker: BrokerView,
    pipeline: Pipeline,
    committed: Mapping[TopicPartition, int] | None,
    batch_id: int,
    options: BatchOptions,
    on_out_of_range: OnOutOfRange | None = None,
) -> BatchPlan:
    src = pipeline.source
    return plan_batch(
        broker,
        pipeline=pipeline.name,
        batch_id=batch_id,
        topics=src.topics,
        committed=committed,
        starting=starting_position(pipeline),
        limits=BatchLimits(
            src.max_records_per_partition,
            options.max_records_per_batch or src.max_records_per_batch,
        ),
        until_timestamp_ms=options.until_timestamp_ms,
        on_out_of_range=on_out_of_range or src.on_out_of_range,
        now_ms=processing_time_ms(options.until_timestamp_ms),
    )


def processing_time_ms(until_timestamp_ms: int | None) -> int:
    """The batch's clock (TTL, idle partitions, hence the watermark): the end of its data
    interval when it has one and it has passed, else now. So a backfill of an interval
    decides expiry and idleness exactly as the scheduled run of that interval did."""
    now = int(time.time() * 1000)
    return now if until_timestamp_ms is None else min(until_timestamp_ms, now)


def starting_position(pipeline: Pipeline) -> StartingPosition:
    s = pipeline.source.starting
    if s == "earliest":
        return StartingPosition.earliest()
    if s == "latest":
        return StartingPosition.latest()
    return StartingPosition.timestamp(int(s))
