"""Consumer lag, and mirroring checkpoint offsets to a Kafka consumer group.

The checkpoint manifest is the only authority on offsets. Committing the same snapshot to
a consumer group named after the pipeline is a courtesy to operators: ``kafka-consumer-
groups.sh``, Burrow, Kafka UI and friends then show the pipeline's lag. The group is never
read back, and a failed mirror never fails a batch (callers log it and carry on).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from microbatch.errors import SourceError
from microbatch.kafka.offsets import TopicPartition

GROUP_PREFIX = "microbatch."


def consumer_group_name(pipeline: str) -> str:
    """The consumer group that mirrors ``pipeline``'s offsets: ``microbatch.<pipeline>``."""
    if not pipeline:
        raise SourceError("a pipeline name is needed to name its consumer group")
    return GROUP_PREFIX + pipeline


def partition_lag(
    end_offsets: Mapping[TopicPartition, int],
    committed: Mapping[TopicPartition, int],
    beginning_offsets: Mapping[TopicPartition, int] | None = None,
) -> dict[TopicPartition, int]:
    """Offsets not yet processed per partition of ``end_offsets``, never negative.

    A partition missing from ``committed`` (not read yet) lags by everything from its
    beginning offset (0 if ``beginning_offsets`` does not say).
    """
    beginning = beginning_offsets or {}
    out: dict[TopicPartition, int] = {}
    for tp in sorted(end_offsets):
        key = TopicPartition(*tp)
        done = committed.get(key, beginning.get(key, 0))
        out[key] = max(0, end_offsets[tp] - done)
    return out


def mirror_offsets(
    bootstrap_servers: str,
    group_id: str,
    offsets: Mapping[TopicPartition, int],
    *,
    timeout_s: float = 30.0,
    client_config: Mapping[str, Any] | None = None,
) -> None:
    """Commit ``offsets`` (next offset to read, per partition) to consumer group ``group_id``.

    Uses a consumer that never joins the group (no subscription), so it does not trigger
    rebalances; the commit fails if live members of another application use the group.
    """
    if not offsets:
        return
    from kafka import KafkaConsumer, OffsetAndMetadata
    from kafka import TopicPartition as KafkaTopicPartition

    commit = {
        KafkaTopicPartition(tp[0], tp[1]): OffsetAndMetadata(int(o), "", -1)
        for tp, o in sorted(offsets.items())
    }
    timeout_ms = int(timeout_s * 1000)
    try:
        consumer = KafkaConsumer(
            bootstrap_servers=bootstrap_servers,
            group_id=group_id,
            enable_auto_commit=False,
            request_timeout_ms=max(timeout_ms, 1000),
            **(client_config or {}),
        )
    except Exception as exc:
        raise SourceError(
            f"mirroring offsets to group {group_id!r}: cannot connect to {bootstrap_servers}: "
            f"{exc!r}"
        ) from exc
    try:
        consumer.commit(commit, timeout_ms=timeout_ms)
    except Exception as exc:
        raise SourceError(
            f"mirroring {len(commit)} offsets to consumer group {group_id!r} on "
            f"{bootstrap_servers} failed: {exc!r}. The checkpoint is unaffected; lag tools "
            "show stale values until the next batch mirrors again."
        ) from exc
    finally:
        consumer.close(autocommit=False)
