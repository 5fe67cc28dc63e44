"""Offsets as values: a partition id, a half-open offset range, and the JSON snapshot.

The snapshot is what a checkpoint manifest stores under ``metadata["offsets"]``: the next
offset to read for *every* partition the pipeline knows (union semantics, seed 002), so a
restore at any source parallelism finds every partition's position. Its JSON form is
``{"topic": {"partition": offset}}`` with topics sorted and partitions sorted numerically,
so the same snapshot always serializes to the same bytes.

Offsets are Kafka's: a range ``[start, end)`` spans ``end - start`` offsets, which is an
upper bound on the records in it (compaction and transaction markers leave gaps).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, NamedTuple

from microbatch.errors import SourceError


class TopicPartition(NamedTuple):
    """One Kafka partition; sorts by topic, then partition number."""

    topic: str
    partition: int

    def __str__(self) -> str:
        return f"{self.topic}[{self.partition}]"


@dataclasses.dataclass(frozen=True, order=True)
class OffsetRange:
    """Offsets ``[start, end)`` of one partition; empty when ``start == end``."""

    topic: str
    partition: int
    start: int
    end: int

    def __post_init__(self) -> None:
        if not isinstance(self.topic, str) or not self.topic:
            raise SourceError(f"offset range needs a topic name, got {self.topic!r}")
        if self.partition < 0:
            raise SourceError(f"{self.topic}[{self.partition}]: partition must be ≥ 0")
        if not 0 <= self.start <= self.end:
            raise SourceError(
                f"{self.topic}[{self.partition}]: bad offset range [{self.start}, {self.end}): "
                "expected 0 ≤ start ≤ end"
            )

    @property
    def tp(self) -> TopicPartition:
        return TopicPartition(self.topic, self.partition)

    @property
    def count(self) -> int:
        """Offsets spanned; an upper bound on records (gaps are possible)."""
        return self.end - self.start

    def split(self, max_records: int) -> list[OffsetRange]:
        """Contiguous pieces of at most ``max_records`` offsets, sizes differing by ≤ 1.

        Balanced pieces keep parallel readers evenly loaded; the pieces cover the range
        exactly, in order, so reading them all equals reading the whole range.
        """
        if max_records < 1:
            raise SourceError(f"{self.tp}: max_records must be ≥ 1, got {max_records}")
        if self.count == 0:
            return []
        pieces = -(-self.count // max_records)
        base, extra = divmod(self.count, pieces)
        out: list[OffsetRange] = []
        start = self.start
        for i in range(pieces):
            end = start + base + (1 if i < extra else 0)
            out.append(OffsetRange(self.topic, self.partition, start, end))
            start = end
        return out

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> OffsetRange:
        return cls(str(data["topic"]), int(data["partition"]), int(data["start"]), int(data["end"]))


def snapshot_to_json(offsets: Mapping[TopicPartition, int]) -> dict[str, dict[str, int]]:
    """``{topic: {partition: offset}}``, sorted, for the manifest's ``metadata["offsets"]``."""
    out: dict[str, dict[str, int]] = {}
    for tp in sorted(offsets, key=lambda t: (t[0], t[1])):
        offset = offsets[tp]
        if offset < 0:
            raise SourceError(f"{tp[0]}[{tp[1]}]: snapshot offset must be ≥ 0, got {offset}")
        out.setdefault(tp[0], {})[str(tp[1])] = int(offset)
    return out


def snapshot_from_json(data: Mapping[str, Mapping[str, int]]) -> dict[TopicPartition, int]:
    """Inverse of :func:`snapshot_to_json`; validates what an old manifest holds."""
    out: dict[TopicPartition, int] = {}
    for topic in sorted(data):
        partitions = data[topic]
        if not isinstance(partitions, Mapping):
            raise SourceError(
                f"offset snapshot for topic {topic!r} must map partition → offset, "
                f"got {partitions!r}"
            )
        for key in sorted(partitions, key=int):
            offset = partitions[key]
            if not isinstance(offset, int) or isinstance(offset, bool) or offset < 0:
                raise SourceError(
                    f"offset snapshot {topic}[{key}] must be an integer ≥ 0, got {offset!r}"
                )
            out[TopicPartition(topic, int(key))] = offset
    return out
