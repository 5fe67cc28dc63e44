"""The dead-letter sink, and the shape of a dead letter in Parquet and in Kafka.

A dead letter keeps the record's original bytes and says why it was set aside and where
it came from, so it can be inspected and replayed. In Parquet: one row with the columns of
:data:`DEAD_LETTER_SCHEMA`. In Kafka: the original key and value, and the rest as
``microbatch.*`` headers (the convention Kafka Connect uses for its dead-letter queues).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import pyarrow as pa

from microbatch.datasets import DatasetRef
from microbatch.errors import ConfigError
from microbatch.settings import Settings
from microbatch.sinks.base import Awaiting, PublishContext, Sink, StageContext, Staged
from microbatch.sinks.kafka import MESSAGE_SCHEMA, KafkaSink
from microbatch.sinks.parquet import ParquetSink
from microbatch.validation import check_name

#: The name of the dead-letter sink among a pipeline's sinks (staged output, stats).
DEAD_LETTER_SINK = "dead_letters"

DEAD_LETTER_SCHEMA = pa.schema(
    [
        ("pipeline", pa.string()),
        ("batch_id", pa.int64()),
        ("reason", pa.string()),
        ("error", pa.string()),
        ("topic", pa.string()),
        ("partition", pa.int32()),
        ("offset", pa.int64()),
        ("attempts", pa.int32()),
        ("raw_key", pa.binary()),
        ("raw_value", pa.binary()),
        # The uid of the keyed step that set the record aside (null: before any step, or a
        # single-operator pipeline without uid). Batches written before it lack it.
        ("step", pa.string()),
    ]
)


def dead_letter_table(rows: Sequence[dict[str, Any]]) -> pa.Table:
    return pa.Table.from_pylist(list(rows), schema=DEAD_LETTER_SCHEMA)


def dead_letter_messages(rows: Sequence[dict[str, Any]]) -> pa.Table:
    keys, values, headers = [], [], []
    for r in rows:
        keys.append(r["raw_key"])
        values.append(r["raw_value"])
        h = [
            ("microbatch.pipeline", r["pipeline"]),
            ("microbatch.batch_id", str(r["batch_id"])),
            ("microbatch.reason", r["reason"]),
            ("microbatch.error", r["error"] or ""),
            ("microbatch.topic", r["topic"] or ""),
            ("microbatch.partition", "" if r["partition"] is None else str(r["partition"])),
            ("microbatch.offset", "" if r["offset"] is None else str(r["offset"])),
            ("microbatch.attempts", "" if r["attempts"] is None else str(r["attempts"])),
            ("microbatch.step", r.get("step") or ""),
        ]
        headers.append([{"key": k, "value": v.encode()} for k, v in h])
    return pa.table({"key": keys, "value": values, "headers": headers}, schema=MESSAGE_SCHEMA)


@dataclasses.dataclass(frozen=True)
class DeadLetterSink(Sink):
    """Where bad records go: a Kafka ``topic`` or a Parquet ``path`` (exactly one).

    Every dead letter carries the reason, the error, the source topic/partition/offset,
    and the raw key and value. ``max_ratio`` fails the batch when more than that fraction
    of its records are dead letters (None: never). Its rows are the runtime's dead-letter
    dicts (the columns of :data:`DEAD_LETTER_SCHEMA`); staging and publishing are those
    of the Kafka or Parquet sink it writes to.
    """

    topic: str | None = None
    path: str | None = None
    max_ratio: float | None = None

    def __post_init__(self) -> None:
        if (self.topic is None) == (self.path is None):
            raise ConfigError("DeadLetterSink needs exactly one of topic= or path=")
        if self.topic is not None:
            check_name("dead-letter topic", self.topic)
        if self.max_ratio is not None and not (0 <= self.max_ratio <= 1):
            raise ConfigError(f"DeadLetterSink max_ratio must be in 0..1: {self.max_ratio!r}")

    @property
    def name(self) -> str:  # type: ignore[override]
        return DEAD_LETTER_SINK

    @property
    def retractable(self) -> bool:  # type: ignore[override]
        return self.target.retractable

    @property
    def target(self) -> KafkaSink | ParquetSink:
        """The sink the dead letters are written to."""
        if self.topic is not None:
            return KafkaSink(DEAD_LETTER_SINK, self.topic)
        return ParquetSink(DEAD_LETTER_SINK, self.path or "")

    def stage(self, ctx: StageContext, rows: Sequence[Any]) -> Staged | None:
        table = dead_letter_messages(rows) if self.topic else dead_letter_table(rows)
        return self.target.stage_table(ctx, table)

    def publish(self, ctx: PublishContext) -> None:
        self.target.publish(ctx)

    def publish_rewind(self, ctx: PublishContext, undone: Sequence[int]) -> None:
        self.target.publish_rewind(ctx, undone)

    def awaiting_replacement(self, settings: Settings, undone: Sequence[int]) -> Awaiting:
        return self.target.awaiting_replacement(settings, undone)

    def collect_orphans(self, settings: Settings, batches: Sequence[int]) -> int:
        return self.target.collect_orphans(settings, batches)

    def shared_storage_url(self) -> str | None:
        return self.target.shared_storage_url()

    def dataset(self, settings: Settings) -> DatasetRef | None:
        return self.target.dataset(settings)

    def last_published(self, settings: Settings, pipeline: str) -> int | None:
        return self.target.last_published(settings, pipeline)


def check_sinks(where: str, sinks: Sequence[Any], dead_letters: Any) -> None:
    """A pipeline's declared outputs: sinks implementing the protocol, a
    :class:`DeadLetterSink` (or None) for the dead letters, names unique."""
    for s in sinks:
        if not isinstance(s, Sink):
            raise ConfigError(
                f"{where}: {s!r} is not a sink (a microbatch.sinks.Sink: ParquetSink, "
                "KafkaSink or your own subclass)"
            )
    if dead_letters is not None and not isinstance(dead_letters, DeadLetterSink):
        raise ConfigError(f"{where}: dead_letters must be a DeadLetterSink: {dead_letters!r}")
    names = [s.name for s in sinks] + ([DEAD_LETTER_SINK] if dead_letters is not None else [])
    if len(set(names)) != len(names):
        raise ConfigError(f"{where}: sink names must be unique, got {names}")
