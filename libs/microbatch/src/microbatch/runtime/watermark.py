"""Event-time watermarks across source partitions (pure).

Per source partition we remember the largest event time seen and when (processing time)
it last had a record. After a batch, with ``EventTime(watermark="min_partition")`` (the
default, Flink's rule)::

    partition watermark = max event time of the partition - allowed lateness
    pipeline watermark  = min over *active* partitions of their watermark
    active              = had a record within ``idle_timeout_s`` of processing time

If every partition is idle the stream has caught up, and the watermark becomes the max
over partitions (otherwise one quiet partition would hold every timer back forever).

With ``watermark="global_max"`` (Spark Structured Streaming's ``withWatermark``)::

    pipeline watermark  = max event time over all partitions - allowed lateness

Watermarks never go back. Records with an event time behind the watermark a batch
starts with are late (they go to the dead letters).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from microbatch.runtime.pipeline import EventTime


@dataclasses.dataclass(frozen=True)
class PartitionTime:
    max_event_ms: int
    last_seen_ms: int


@dataclasses.dataclass(frozen=True)
class WatermarkState:
    """What the manifest stores: per-partition times and the current watermark."""

    partitions: Mapping[str, PartitionTime] = dataclasses.field(default_factory=dict)
    watermark: int | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "watermark": self.watermark,
            "partitions": {
                k: [v.max_event_ms, v.last_seen_ms] for k, v in sorted(self.partitions.items())
            },
        }

    @classmethod
    def from_json(cls, body: Mapping[str, Any] | None) -> WatermarkState:
        if not body:
            return cls()
        parts = {k: PartitionTime(*v) for k, v in body.get("partitions", {}).items()}
        return cls(parts, body.get("watermark"))


def partition_name(topic: str, partition: int) -> str:
    return f"{topic}/{partition}"


def advance(
    state: WatermarkState,
    batch_max: Mapping[str, int],
    processing_time_ms: int,
    event_time: EventTime,
) -> WatermarkState:
    """The state after a batch whose records had max event times ``batch_max``."""
    parts = dict(state.partitions)
    for name, ts in batch_max.items():
        old = parts.get(name)
        top = ts if old is None else max(old.max_event_ms, ts)
        parts[name] = PartitionTime(top, processing_time_ms)
    if not parts:
        return WatermarkState(parts, state.watermark)
    lateness = int(event_time.allowed_lateness_s * 1000)
    if event_time.watermark == "global_max":
        active = []  # as if every partition were idle: the max over all of them
    elif event_time.idle_timeout_s is None:
        active = list(parts.values())
    else:
        horizon = processing_time_ms - int(event_time.idle_timeout_s * 1000)
        active = [p for p in parts.values() if p.last_seen_ms >= horizon]
    if active:
        candidate = min(p.max_event_ms for p in active) - lateness
    else:
        candidate = max(p.max_event_ms for p in parts.values()) - lateness
    if state.watermark is not None:
        candidate = max(candidate, state.watermark)
    return WatermarkState(parts, candidate)
