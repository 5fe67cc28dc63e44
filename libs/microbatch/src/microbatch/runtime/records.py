"""Typed records one phase of a batch hands the next, each with ``to_json``/``from_json``.

- :class:`InstanceResult` — what a stage-2 instance returns to the driver;
- :class:`BatchRecord` — the batch as the manifest records it (its ``metadata``): offsets,
  event time, staged sink output, pending enrichment, what it supersedes, where a copy
  came from, stats.

The JSON is the manifest's format: keys and shapes are stable, checkpoints written by
earlier versions read back (missing keys take their defaults), and keys this version does
not know are carried through unchanged (:attr:`BatchRecord.extra`).
"""

from __future__ import annotations

import base64
import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

from microbatch.checkpoint import InstanceSnapshot, Manifest
from microbatch.kafka.offsets import TopicPartition, snapshot_from_json, snapshot_to_json
from microbatch.runtime.watermark import WatermarkState
from microbatch.sinks.base import Awaiting, Staged

# ---------------------------------------------------------------------- stage 1 → 2


@dataclasses.dataclass(frozen=True)
class PartitionCounts:
    """What stage 1 made of one source partition's records."""

    inputs: int = 0
    records: int = 0
    dead_letters: int = 0

    def to_json(self) -> dict[str, int]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, body: Mapping[str, Any]) -> PartitionCounts:
        return cls(body.get("inputs", 0), body.get("records", 0), body.get("dead_letters", 0))


class TotalsTally:
    """Stage-1 counts added up partition by partition. A partition may come in several
    parts (tasks, instances): its counts add up, its event times take the max."""

    def __init__(self) -> None:
        self.pending = 0
        self.max_event: dict[str, int] = {}
        self.per: dict[str, list[int]] = {}
        self.sums: dict[str, list[int]] = {}

    def add(self, name: str, counts: PartitionCounts, pending: int, max_event: int | None,
            offset_sums: tuple[int, int, int]) -> None:  # fmt: skip
        per = self.per.setdefault(name, [0, 0, 0])
        per[0] += counts.inputs
        per[1] += counts.records
        per[2] += counts.dead_letters
        sums = self.sums.setdefault(name, [0, 0, 0])
        for i, n in enumerate(offset_sums):
            sums[i] += n
        self.pending += pending
        if max_event is not None:
            top = self.max_event.get(name)
            self.max_event[name] = max_event if top is None else max(top, max_event)

    def totals(self) -> StageOneTotals:
        per = self.per.values()
        return StageOneTotals(
            inputs=sum(c[0] for c in per),
            records=sum(c[1] for c in per),
            dead=sum(c[2] for c in per),
            pending=self.pending,
            max_event=dict(sorted(self.max_event.items())),
            per_partition={name: PartitionCounts(*c) for name, c in sorted(self.per.items())},
            offset_sums={name: (s[0], s[1], s[2]) for name, s in sorted(self.sums.items())},
        )


@dataclasses.dataclass(frozen=True)
class StageOneTotals:
    """The batch's stage-1 counts, from every task's ``stat`` rows; ``max_event`` (the max
    event time per partition) is what the watermark advances by."""

    inputs: int = 0  # Kafka records consumed (re-issued pending elements are not inputs)
    records: int = 0
    dead: int = 0
    pending: int = 0
    max_event: Mapping[str, int] = dataclasses.field(default_factory=dict)
    per_partition: Mapping[str, PartitionCounts] = dataclasses.field(default_factory=dict)
    #: Per partition, the sums of the source offsets of its records, dead letters and
    #: pending rows: what lets instances tell that they saw the same stage-1 output.
    offset_sums: Mapping[str, tuple[int, int, int]] = dataclasses.field(default_factory=dict)

    @classmethod
    def sum_of(cls, parts: Iterable[StageOneTotals]) -> StageOneTotals:
        """The totals of a batch whose stage 1 ran in parts that each saw their own
        partitions' records (:mod:`.one_stage`): counts add up, event times take the max."""
        tally = TotalsTally()
        for part in parts:
            for name, counts in part.per_partition.items():
                sums = part.offset_sums.get(name, (0, 0, 0))
                tally.add(name, counts, 0, part.max_event.get(name), sums)
            tally.pending += part.pending
        return tally.totals()

    def to_json(self) -> dict[str, Any]:
        return {
            "inputs": self.inputs,
            "records": self.records,
            "dead": self.dead,
            "pending": self.pending,
            "max_event": dict(self.max_event),
            "per_partition": {k: v.to_json() for k, v in self.per_partition.items()},
            "offset_sums": {k: list(v) for k, v in self.offset_sums.items()},
        }

    @classmethod
    def from_json(cls, body: Mapping[str, Any]) -> StageOneTotals:
        return cls(
            inputs=body["inputs"],
            records=body["records"],
            dead=body["dead"],
            pending=body["pending"],
            max_event=dict(body["max_event"]),
            per_partition={
                k: PartitionCounts.from_json(v) for k, v in body["per_partition"].items()
            },
            offset_sums={k: tuple(v) for k, v in body.get("offset_sums", {}).items()},
        )


@dataclasses.dataclass(frozen=True)
class PendingInput:
    """An enrichment input not finished by the deadline, on its way to the checkpoint."""

    topic: str
    partition: int
    offset: int
    payload: bytes

    def to_json(self) -> list[Any]:
        payload = base64.b64encode(self.payload).decode("ascii")
        return [self.topic, self.partition, self.offset, payload]

    @classmethod
    def from_json(cls, body: list[Any]) -> PendingInput:
        topic, partition, offset, payload = body
        return cls(topic, partition, offset, base64.b64decode(payload))


# ---------------------------------------------------------------------- stage 2 → driver


@dataclasses.dataclass(frozen=True)
class InstanceResult:
    """What one operator instance did in stage 2, for the driver's manifest."""

    instance: int
    #: Stage 1's totals and the event-time state they advance the batch to: every
    #: instance computes both from the same ``stat`` rows, the driver checks they agree.
    stage_one: StageOneTotals
    event_time: WatermarkState
    pending: tuple[PendingInput, ...]
    snapshot: InstanceSnapshot
    #: Sink name → what this instance staged for it (None: no rows).
    staged: Mapping[str, Staged | None]
    #: ``records``, ``keys``, ``timers_fired``, ``dead_letters``, ``dead_letters.<reason>``,
    #: ``out.<sink>``.
    counters: Mapping[str, int]
    restored: Mapping[str, int]
    seconds: Mapping[str, float]

    def to_json(self) -> dict[str, Any]:
        return {
            "instance": self.instance,
            "stage_one": self.stage_one.to_json(),
            "event_time": self.event_time.to_json(),
            "pending": [p.to_json() for p in self.pending],
            "snapshot": self.snapshot.to_json(),
            "staged": {k: None if v is None else v.to_json() for k, v in self.staged.items()},
            "counters": dict(self.counters),
            "restored": dict(self.restored),
            "seconds": dict(self.seconds),
        }

    @classmethod
    def from_json(cls, body: Mapping[str, Any]) -> InstanceResult:
        return cls(
            instance=body["instance"],
            stage_one=StageOneTotals.from_json(body["stage_one"]),
            event_time=WatermarkState.from_json(body["event_time"]),
            pending=tuple(PendingInput.from_json(p) for p in body["pending"]),
            snapshot=InstanceSnapshot.from_json(body["snapshot"]),
            staged={
                k: None if v is None else Staged.from_json(v) for k, v in body["staged"].items()
            },
            counters=dict(body["counters"]),
            restored=dict(body["restored"]),
            seconds=dict(body["seconds"]),
        )


# ---------------------------------------------------------------------- the manifest


@dataclasses.dataclass(frozen=True)
class BatchInfo:
    """How a batch ran: the manifest's ``batch`` object."""

    parallelism: int | None = None
    #: The batch's recorded processing time (when it was planned): its clock for TTLs,
    #: idle partitions and timers, the same on every rerun.
    processing_time_ms: int | None = None
    until_timestamp_ms: int | None = None  # the data interval's end, if the run had one
    interval_start_ms: int | None = None
    #: Did the batch read everything before ``until_timestamp_ms`` (no limit cut it)?
    ends_exactly: bool = True
    #: The checkpoint it started from; None for the first batch of a lineage.
    base_checkpoint: int | None = None
    #: Where the first batch started (a rewind to before it starts there again).
    from_offsets: Mapping[str, Mapping[str, int]] | None = None
    run_id: str | None = None
    replayed: bool = False  # an earlier attempt stored the plan

    def to_json(self) -> dict[str, Any]:
        body = dataclasses.asdict(self)
        if self.from_offsets is None:
            del body["from_offsets"]
        return body

    @classmethod
    def from_json(cls, body: Mapping[str, Any], checkpoint_id: int) -> BatchInfo:
        """``checkpoint_id``: the batch's own id (an old record without
        ``base_checkpoint`` started from the one before it)."""
        names = {f.name for f in dataclasses.fields(cls)}
        known = {k: v for k, v in body.items() if k in names}
        known.setdefault("base_checkpoint", checkpoint_id - 1)
        return cls(**known)

    @property
    def end_ms(self) -> int | None:
        """How far the batch read, in record time: its interval end, else when it was
        planned (a run without an end reads to the end of the log)."""
        if self.until_timestamp_ms is not None:
            return self.until_timestamp_ms
        return self.processing_time_ms


@dataclasses.dataclass(frozen=True)
class PendingRef:
    """The checkpoint's file of pending enrichment inputs."""

    file: str
    count: int

    def to_json(self) -> dict[str, Any]:
        return {"file": self.file, "count": self.count}

    @classmethod
    def from_json(cls, body: Mapping[str, Any] | None) -> PendingRef | None:
        return None if not body else cls(body["file"], body["count"])


@dataclasses.dataclass(frozen=True)
class ReplayOrigin:
    """A rewind's copy: of which checkpoint (None: the position before the first batch),
    undoing the checkpoints ``undone`` (first, last)."""

    checkpoint_id: int | None
    undone: tuple[int, int]

    def to_json(self) -> dict[str, Any]:
        return {"checkpoint_id": self.checkpoint_id, "undone": list(self.undone)}

    @classmethod
    def from_json(cls, body: Mapping[str, Any]) -> ReplayOrigin:
        first, last = body["undone"]
        return cls(body.get("checkpoint_id"), (first, last))


@dataclasses.dataclass(frozen=True)
class ReshardOrigin:
    """A reshard's copy: of which checkpoint, at which max_parallelism before."""

    checkpoint_id: int
    max_parallelism: int

    def to_json(self) -> dict[str, Any]:
        return {"checkpoint_id": self.checkpoint_id, "max_parallelism": self.max_parallelism}

    @classmethod
    def from_json(cls, body: Mapping[str, Any]) -> ReshardOrigin:
        return cls(body["checkpoint_id"], body["max_parallelism"])


@dataclasses.dataclass(frozen=True)
class InstanceStats:
    """One instance's counters and phase seconds, as the batch's stats keep them."""

    instance: int
    counters: Mapping[str, int]
    seconds: Mapping[str, float]

    def to_json(self) -> dict[str, Any]:
        return {"instance": self.instance, **self.counters, "seconds": dict(self.seconds)}

    @classmethod
    def from_json(cls, body: Mapping[str, Any]) -> InstanceStats:
        counters = {k: v for k, v in body.items() if k not in ("instance", "seconds")}
        return cls(body["instance"], counters, dict(body.get("seconds", {})))


@dataclasses.dataclass(frozen=True)
class BatchStats:
    """What a batch counted: the manifest's ``stats`` object (the CLI, UI, bench show it)."""

    records_in: int = 0
    dead_letters: int = 0
    dead_letter_reasons: Mapping[str, int] = dataclasses.field(default_factory=dict)
    outputs: Mapping[str, int] = dataclasses.field(default_factory=dict)
    enrich_pending: int = 0
    enrich_reissued: int = 0
    per_partition: Mapping[str, PartitionCounts] = dataclasses.field(default_factory=dict)
    skipped: Mapping[str, Mapping[str, int]] = dataclasses.field(default_factory=dict)
    reader: str | None = None  # "spark", "python" or None (no input)
    #: Driver-side phases up to the commit (publish and GC come after it).
    seconds: Mapping[str, float] = dataclasses.field(default_factory=dict)
    instances: tuple[InstanceStats, ...] = ()

    def to_json(self) -> dict[str, Any]:
        body = dataclasses.asdict(self)
        body["per_partition"] = {k: v.to_json() for k, v in self.per_partition.items()}
        body["instances"] = [i.to_json() for i in self.instances]
        return body

    @classmethod
    def from_json(cls, body: Mapping[str, Any]) -> BatchStats:
        names = {f.name for f in dataclasses.fields(cls)}
        known = {k: v for k, v in body.items() if k in names}
        known["per_partition"] = {
            k: PartitionCounts.from_json(v) for k, v in body.get("per_partition", {}).items()
        }
        known["instances"] = tuple(InstanceStats.from_json(i) for i in body.get("instances", ()))
        return cls(**known)


_KNOWN = (
    "batch", "offsets", "event_time", "watermark", "enrich_pending", "sinks", "supersedes",
    "awaiting_replacement", "stats", "replayed_from", "resharded_from",
)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class BatchRecord:
    """A checkpoint's batch: what its manifest's ``metadata`` holds.

    A batch the runtime ran has every field; a rewind's copy keeps its source's record
    (the copy stands for it in the lineage) without ``sinks``/``stats``/``supersedes``,
    plus :attr:`replayed_from`; a reshard's copy adds :attr:`resharded_from`. A field
    the record does not have is None.
    """

    #: The offset after the last record read, of every partition ever seen.
    offsets: Mapping[TopicPartition, int] = dataclasses.field(default_factory=dict)
    batch: BatchInfo | None = None
    event_time: WatermarkState | None = None
    watermark: int | None = None
    enrich_pending: PendingRef | None = None
    #: Sink name → what each instance staged (None: nothing), in instance order.
    sinks: Mapping[str, tuple[Staged | None, ...]] | None = None
    supersedes: tuple[int, ...] | None = None
    #: Undone batches whose output still awaits replacement (None: not recorded).
    awaiting_replacement: Awaiting | None = None
    stats: BatchStats | None = None
    replayed_from: ReplayOrigin | None = None
    resharded_from: ReshardOrigin | None = None
    #: Keys this version does not know, kept as they are.
    extra: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    @classmethod
    def of(cls, manifest: Manifest | None) -> BatchRecord:
        """The record of a committed checkpoint (an empty one for no checkpoint)."""
        if manifest is None:
            return cls()
        return cls.from_json(manifest.metadata, manifest.checkpoint_id)

    def to_json(self) -> dict[str, Any]:
        body: dict[str, Any] = dict(self.extra)
        if self.batch is not None:
            body["batch"] = self.batch.to_json()
        body["offsets"] = snapshot_to_json(self.offsets)
        if self.event_time is not None:
            body["event_time"] = self.event_time.to_json()
        body["watermark"] = self.watermark
        body["enrich_pending"] = (
            None if self.enrich_pending is None else self.enrich_pending.to_json()
        )
        if self.sinks is not None:
            body["sinks"] = {
                name: [None if s is None else s.to_json() for s in staged]
                for name, staged in self.sinks.items()
            }
        if self.supersedes is not None:
            body["supersedes"] = list(self.supersedes)
        if self.awaiting_replacement is not None:
            body["awaiting_replacement"] = dict(self.awaiting_replacement)
        if self.stats is not None:
            body["stats"] = self.stats.to_json()
        if self.replayed_from is not None:
            body["replayed_from"] = self.replayed_from.to_json()
        if self.resharded_from is not None:
            body["resharded_from"] = self.resharded_from.to_json()
        return body

    @classmethod
    def from_json(cls, body: Mapping[str, Any], checkpoint_id: int) -> BatchRecord:
        def opt(key: str, parse: Any) -> Any:
            value = body.get(key)
            return None if value is None else parse(value)

        return cls(
            offsets=snapshot_from_json(body.get("offsets", {})),
            batch=opt("batch", lambda b: BatchInfo.from_json(b, checkpoint_id) if b else None),
            event_time=opt("event_time", WatermarkState.from_json),
            watermark=body.get("watermark"),
            enrich_pending=PendingRef.from_json(body.get("enrich_pending")),
            sinks=opt("sinks", _staged_from_json),
            supersedes=opt("supersedes", tuple),
            awaiting_replacement=opt("awaiting_replacement", dict),
            stats=opt("stats", BatchStats.from_json),
            replayed_from=opt("replayed_from", ReplayOrigin.from_json),
            resharded_from=opt("resharded_from", ReshardOrigin.from_json),
            extra={k: v for k, v in body.items() if k not in _KNOWN},
        )

    @property
    def source_of_copy(self) -> int | None:
        """The checkpoint a rewind's or reshard's copy stands for (None: not a copy, or a
        rewind to before the first batch)."""
        for origin in (self.replayed_from, self.resharded_from):
            if origin is not None and origin.checkpoint_id is not None:
                return origin.checkpoint_id
        return None


def _staged_from_json(body: Mapping[str, Any]) -> dict[str, tuple[Staged | None, ...]]:
    return {
        name: tuple(None if s is None else Staged.from_json(s) for s in staged)
        for name, staged in body.items()
    }
