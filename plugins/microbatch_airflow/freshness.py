"""Is there work for the next batch? Pure decision logic plus the one I/O check.

A batch is worth running when any of these holds (checked in this order):

1. the pipeline has no checkpoint yet (the first batch establishes it);
2. the newest checkpoint is committed but not yet published (a rerun publishes it);
3. a source partition has records beyond the committed offsets (including partitions
   the checkpoint has not seen yet);
4. async enrichment left elements pending (the next batch re-issues them);
5. event time: a batch *now* would advance the watermark — partitions went idle since
   the last batch — so event-time timers could fire. Timer timestamps are not visible
   without restoring state, so this is conservative: it may run a batch with no due
   timer, never skip one with a due timer.

Otherwise the batch is idle and can be skipped (``skip_when_idle=True``, the default of
the DAG factory). Pipelines whose output depends on processing time alone (TTL clean-up
on a schedule) should set ``skip_when_idle=False``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from microbatch.settings import Settings


@dataclasses.dataclass(frozen=True)
class PipelineFacts:
    """What the check needs to know about a pipeline: plain, serializable values."""

    name: str
    checkpoints: str
    topics: tuple[str, ...]
    allowed_lateness_s: float | None = None  # None: the pipeline has no event time
    idle_timeout_s: float | None = None

    @classmethod
    def from_pipeline(cls, pipeline: Any) -> PipelineFacts:
        et = pipeline.event_time
        return cls(
            name=pipeline.name,
            checkpoints=pipeline.checkpoints,
            topics=tuple(pipeline.source.topics),
            allowed_lateness_s=None if et is None else float(et.allowed_lateness_s),
            idle_timeout_s=None if et is None or et.idle_timeout_s is None else et.idle_timeout_s,
        )

    def to_json(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "topics": list(self.topics)}

    @classmethod
    def from_json(cls, body: Mapping[str, Any]) -> PipelineFacts:
        return cls(**{**body, "topics": tuple(body["topics"])})


@dataclasses.dataclass(frozen=True)
class Decision:
    run: bool
    reason: str
    new_records: int = 0
    lag: Mapping[str, int] = dataclasses.field(default_factory=dict)

    def event(self) -> dict[str, Any]:
        """The trigger event payload: ``{"status", "message", ...}``."""
        return {
            "status": "new_data" if self.run else "idle",
            "message": self.reason,
            "new_records": self.new_records,
            "lag": dict(self.lag),
        }


def decide(
    facts: PipelineFacts,
    manifest: Any | None,
    end_offsets: Mapping[Any, int],
    now_ms: int,
    published: bool = True,
    idle_timers: bool = True,
) -> Decision:
    """The rules of the module docstring; ``end_offsets`` covers every source partition.
    ``idle_timers=False`` leaves rule 5 out (the event-driven trigger: an advancing
    watermark is a matter of time passing, which its DAG's cron, if any, covers)."""
    from microbatch.kafka import partition_lag
    from microbatch.runtime.records import BatchRecord

    if manifest is None:
        return Decision(True, f"pipeline {facts.name!r} has no checkpoint yet: the first batch")
    cid = manifest.checkpoint_id
    if not published:
        return Decision(True, f"checkpoint {cid} is committed but unpublished: publish it")
    record = BatchRecord.of(manifest)
    committed = record.offsets
    lag = {str(tp): n for tp, n in partition_lag(end_offsets, committed).items()}
    new = sum(lag.values())
    if new:
        busy = sorted((tp for tp, n in lag.items() if n), key=lambda tp: -lag[tp])[:3]
        return Decision(
            True, f"{new} new offsets since checkpoint {cid} (most in {', '.join(busy)})", new, lag
        )
    pending = record.enrich_pending
    if pending is not None and pending.count:
        return Decision(
            True, f"{pending.count} async elements pending from checkpoint {cid}", 0, lag
        )
    if idle_timers and facts.allowed_lateness_s is not None:
        event_time = None if record.event_time is None else record.event_time.to_json()
        old, new_wm = watermark_now(facts, event_time, now_ms)
        if new_wm is not None and (old is None or new_wm > old):
            return Decision(
                True,
                f"no new records, but the watermark would advance from {old} to {new_wm} "
                "(partitions went idle): event-time timers may fire",
                0,
                lag,
            )
    return Decision(False, f"no new records since checkpoint {cid} and no timer can fire", 0, lag)


def watermark_now(
    facts: PipelineFacts, event_time_state: Mapping[str, Any] | None, now_ms: int
) -> tuple[int | None, int | None]:
    """(current watermark, watermark after an empty batch at ``now_ms``)."""
    from microbatch.runtime import EventTime
    from microbatch.runtime.watermark import WatermarkState, advance

    state = WatermarkState.from_json(event_time_state)
    spec = EventTime(
        field="_",
        allowed_lateness_s=facts.allowed_lateness_s or 0.0,
        idle_timeout_s=facts.idle_timeout_s,
    )
    return state.watermark, advance(state, {}, now_ms, spec).watermark


def check_for_work(
    facts: PipelineFacts, settings: Settings, now_ms: int, idle_timers: bool = True
) -> Decision:
    """Read the newest manifest and the Kafka end offsets; every client is closed."""
    from microbatch.checkpoint import Layout, latest_manifest
    from microbatch.kafka import KafkaBrokerView, TopicPartition
    from microbatch.runtime.publish import is_published
    from microbatch.runtime.records import BatchRecord
    from microbatch.storage import open_store

    store = open_store(facts.checkpoints, settings)
    manifest = latest_manifest(store, Layout())
    if manifest is None:
        return decide(facts, None, {}, now_ms, idle_timers=idle_timers)
    published = is_published(store, Layout(), manifest.checkpoint_id)
    known = set(BatchRecord.of(manifest).offsets)
    with KafkaBrokerView.for_settings(settings, timeout_s=20.0) as view:
        for topic in facts.topics:
            known |= {TopicPartition(topic, p) for p in view.partitions_for(topic) or ()}
        end = view.end_offsets(sorted(known))
    return decide(facts, manifest, end, now_ms, published, idle_timers)
