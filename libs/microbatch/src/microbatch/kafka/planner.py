"""Plan a batch: the exact offset range of every partition, decided before any work runs.

A plan is a pure function of what the broker reports (a :class:`BrokerView`), the offsets
of the last committed checkpoint, and the options; :class:`PlanStore` writes it with an
exclusive create *before* the batch executes. A rerun after a crash finds the stored plan
and reads exactly the same ranges again — that is what makes a batch replayable.

Per partition, ``from`` is:

- the committed offset, if the last checkpoint has one;
- else the starting position when there is no checkpoint yet (first batch);
- else (a partition created since the last checkpoint) earliest — or the starting
  timestamp, if the pipeline starts from one — so no record of it is missed.

``until`` is the end offset (with ``read_committed``: the last stable offset, never inside
an open transaction), lowered to the first offset at or after ``until_timestamp_ms`` when
one is given (the end of an Airflow data interval), then capped by :class:`BatchLimits`.

A committed offset that retention has already deleted fails the plan (records would be
lost silently), unless ``on_out_of_range="earliest"``, which skips ahead and records how
many offsets were skipped in :attr:`BatchPlan.skipped`.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Collection, Iterable, Mapping
from types import TracebackType
from typing import Any, Literal, Protocol, runtime_checkable

from microbatch.checkpoint.layout import Layout
from microbatch.errors import DataLossError, SourceError
from microbatch.kafka.assignment import source_task
from microbatch.kafka.offsets import (
    OffsetRange,
    TopicPartition,
    snapshot_from_json,
    snapshot_to_json,
)
from microbatch.settings import Settings
from microbatch.storage.base import AlreadyExistsError, ObjectNotFoundError, ObjectStore

OnOutOfRange = Literal["fail", "earliest"]
_ON_OUT_OF_RANGE = ("fail", "earliest")


# --------------------------------------------------------------------------- options


@dataclasses.dataclass(frozen=True)
class StartingPosition:
    """Where partitions without a committed offset start: earliest, latest or a timestamp."""

    kind: Literal["earliest", "latest", "timestamp"]
    timestamp_ms: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in ("earliest", "latest", "timestamp"):
            raise SourceError(
                f"unknown starting position {self.kind!r}: use earliest, latest or timestamp"
            )
        if (self.kind == "timestamp") != (self.timestamp_ms is not None):
            raise SourceError(
                f"starting position {self.kind!r} with timestamp_ms={self.timestamp_ms!r}: "
                "a timestamp is required for 'timestamp' and not allowed otherwise"
            )
        if self.timestamp_ms is not None and self.timestamp_ms < 0:
            raise SourceError(f"starting timestamp_ms must be ≥ 0, got {self.timestamp_ms}")

    @classmethod
    def earliest(cls) -> StartingPosition:
        return cls("earliest")

    @classmethod
    def latest(cls) -> StartingPosition:
        return cls("latest")

    @classmethod
    def timestamp(cls, timestamp_ms: int) -> StartingPosition:
        """The first record with a timestamp ≥ ``timestamp_ms`` (epoch milliseconds)."""
        return cls("timestamp", int(timestamp_ms))

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {"kind": self.kind}
        if self.timestamp_ms is not None:
            data["timestamp_ms"] = self.timestamp_ms
        return data

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> StartingPosition:
        return cls(data["kind"], data.get("timestamp_ms"))


@dataclasses.dataclass(frozen=True)
class BatchLimits:
    """Caps on offsets per batch; ``None`` means unlimited.

    ``max_records_total`` is shared between partitions in proportion to their backlog
    (like Spark's ``maxOffsetsPerTrigger``), with the remainder going to the largest
    fractional shares, ties broken by topic and partition: deterministic, and the sum is
    exactly ``min(total, backlog)``.
    """

    max_records_per_partition: int | None = None
    max_records_total: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_records_per_partition", "max_records_total"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise SourceError(f"BatchLimits.{name} must be ≥ 1 or None, got {value!r}")

    def apply(self, backlog: Mapping[TopicPartition, int]) -> dict[TopicPartition, int]:
        """How many offsets each partition may advance, given its available ``backlog``."""
        allowed = {
            tp: n
            if self.max_records_per_partition is None
            else min(n, self.max_records_per_partition)
            for tp, n in backlog.items()
        }
        total = sum(allowed.values())
        cap = self.max_records_total
        if cap is None or total <= cap:
            return allowed
        shares = {tp: divmod(cap * n, total) for tp, n in allowed.items()}
        out = {tp: q for tp, (q, _) in shares.items()}
        left = cap - sum(out.values())
        by_remainder = sorted(shares, key=lambda tp: (-shares[tp][1], tp))
        for tp in by_remainder[:left]:
            out[tp] += 1
        return out

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# --------------------------------------------------------------------------- broker view


@runtime_checkable
class BrokerView(Protocol):
    """What planning needs to know from Kafka (a test double implements it in memory)."""

    bootstrap_servers: str

    def partitions_for(self, topic: str) -> set[int] | None:
        """Partition ids of ``topic``; ``None`` if the topic does not exist."""

    def beginning_offsets(self, tps: Collection[TopicPartition]) -> dict[TopicPartition, int]:
        """First available offset (after retention) per partition."""

    def end_offsets(self, tps: Collection[TopicPartition]) -> dict[TopicPartition, int]:
        """End offset per partition; with ``read_committed`` the last stable offset."""

    def offsets_for_times(
        self, tps: Collection[TopicPartition], timestamp_ms: int
    ) -> dict[TopicPartition, int | None]:
        """First offset with a timestamp ≥ ``timestamp_ms``; ``None`` if there is none."""


#: How soon kafka-python's cluster metadata may be fetched again after a fetch.
METADATA_BACKOFF_MS = 10


def _quick_metadata(consumer: Any) -> None:
    """kafka-python 3.0 builds its cluster metadata without the consumer's
    ``retry_backoff_ms``, so the first fetch of every topic's metadata after its bootstrap
    (a plan's first question) waits the default 100 ms — 0.1 s of every batch. Shorten
    that wait where the client keeps it (nothing, if a later kafka-python moved it)."""
    cluster = getattr(getattr(consumer, "_manager", None), "cluster", None)
    config = getattr(cluster, "config", None)
    if isinstance(config, dict) and "retry_backoff_ms" in config:
        config["retry_backoff_ms"] = METADATA_BACKOFF_MS


class KafkaBrokerView:
    """:class:`BrokerView` over kafka-python; a context manager that closes its consumer.

    The consumer uses ``isolation_level='read_committed'`` so end offsets are last stable
    offsets: a plan never ends inside a transaction that might still abort.
    """

    def __init__(
        self,
        bootstrap_servers: str,
        timeout_s: float = 30.0,
        client_config: Mapping[str, Any] | None = None,
    ) -> None:
        """``client_config``: how to connect (``Settings.kafka_client_config``)."""
        from kafka import KafkaConsumer

        self.bootstrap_servers = bootstrap_servers
        self.timeout_ms = int(timeout_s * 1000)
        try:
            self._consumer = KafkaConsumer(
                **{  # a caller's consumer settings may repeat these (read_ranges_spark's)
                    **(client_config or {}),
                    "bootstrap_servers": bootstrap_servers,
                    "enable_auto_commit": False,
                    "isolation_level": "read_committed",
                    "request_timeout_ms": max(self.timeout_ms, 1000),
                    # kafka-python waits 30 s for its first broker by default, whatever
                    # the caller's timeout: an unreachable cluster must fail within it.
                    "bootstrap_timeout_ms": max(self.timeout_ms, 1000),
                }
            )
        except Exception as exc:
            raise SourceError(
                f"cannot connect to Kafka at {bootstrap_servers}: {exc} "
                "(check MICROBATCH_KAFKA_BOOTSTRAP_SERVERS, the MICROBATCH_KAFKA_SECURITY_* / "
                "SASL_* settings and that the brokers are up)"
            ) from exc
        _quick_metadata(self._consumer)
        self._topics: set[str] | None = None

    @classmethod
    def for_settings(cls, settings: Settings, timeout_s: float | None = None) -> KafkaBrokerView:
        """A view of the brokers ``settings`` name, connected as they say, waiting for them
        ``timeout_s`` (default: ``settings.kafka_timeout_s``)."""
        timeout = settings.kafka_timeout_s if timeout_s is None else timeout_s
        return cls(settings.kafka_bootstrap_servers, timeout, settings.kafka_client_config())

    def __enter__(self) -> KafkaBrokerView:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        self._consumer.close(autocommit=False)

    def _call(self, what: str, fn: Any, *args: Any) -> Any:
        try:
            return fn(*args, timeout_ms=self.timeout_ms)
        except SourceError:
            raise
        except Exception as exc:
            raise SourceError(
                f"Kafka at {self.bootstrap_servers}: {what} failed: {exc!r} "
                f"(timeout {self.timeout_ms} ms; are the brokers reachable?)"
            ) from exc

    def partitions_for(self, topic: str) -> set[int] | None:
        if self._topics is None:  # one fresh metadata fetch per view: sees new partitions
            self._topics = set(self._consumer.topics())
        if topic not in self._topics:
            return None
        return set(self._consumer.partitions_for_topic(topic) or ()) or None

    @staticmethod
    def _kafka_tps(tps: Iterable[TopicPartition]) -> list[Any]:
        from kafka import TopicPartition as KafkaTopicPartition

        return [KafkaTopicPartition(tp[0], tp[1]) for tp in tps]

    def beginning_offsets(self, tps: Collection[TopicPartition]) -> dict[TopicPartition, int]:
        got = self._call(
            "beginning_offsets", self._consumer.beginning_offsets, self._kafka_tps(tps)
        )
        return {TopicPartition(tp.topic, tp.partition): int(o) for tp, o in got.items()}

    def end_offsets(self, tps: Collection[TopicPartition]) -> dict[TopicPartition, int]:
        got = self._call("end_offsets", self._consumer.end_offsets, self._kafka_tps(tps))
        return {TopicPartition(tp.topic, tp.partition): int(o) for tp, o in got.items()}

    def offsets_for_times(
        self, tps: Collection[TopicPartition], timestamp_ms: int
    ) -> dict[TopicPartition, int | None]:
        query = {tp: int(timestamp_ms) for tp in self._kafka_tps(tps)}
        got = self._call("offsets_for_times", self._consumer.offsets_for_times, query)
        return {
            TopicPartition(tp.topic, tp.partition): (None if found is None else int(found.offset))
            for tp, found in got.items()
        }


# --------------------------------------------------------------------------- the plan


@dataclasses.dataclass(frozen=True)
class BatchPlan:
    """The ranges one batch reads, and where every known partition stands before it.

    ``start_offsets`` holds every partition the pipeline knows (committed ones, new ones,
    ones with nothing to read); ``ranges`` holds only non-empty ranges, one per partition,
    each starting at its partition's start offset. ``skipped`` counts offsets jumped over
    because retention had deleted them (``on_out_of_range="earliest"``).
    """

    pipeline: str
    batch_id: int
    start_offsets: Mapping[TopicPartition, int]
    ranges: tuple[OffsetRange, ...]
    new_partitions: tuple[TopicPartition, ...] = ()
    until_timestamp_ms: int | None = None
    skipped: Mapping[TopicPartition, int] = dataclasses.field(default_factory=dict)
    created_at: int = 0  # epoch milliseconds, informational only
    reaches_until: bool | None = None
    """With an interval end: does every partition stop exactly at it? Not when a limit
    caps the batch, nor when a partition already stood past it (a later interval ran
    first). Only a batch that reaches its end exactly is a place a backfill can start."""

    def __post_init__(self) -> None:
        where = f"plan {self.pipeline!r} batch {self.batch_id}"
        if not self.pipeline:
            raise SourceError("a batch plan needs a pipeline name")
        if self.batch_id < 0:
            raise SourceError(f"{where}: batch_id must be ≥ 0")
        start = {TopicPartition(*tp): int(o) for tp, o in sorted(self.start_offsets.items())}
        ranges = tuple(sorted(self.ranges))
        seen: set[TopicPartition] = set()
        for r in ranges:
            if r.tp in seen:
                raise SourceError(f"{where}: two ranges for {r.tp}")
            seen.add(r.tp)
            if start.get(r.tp) != r.start:
                raise SourceError(
                    f"{where}: range {r.tp} [{r.start}, {r.end}) does not begin at the "
                    f"partition's start offset {start.get(r.tp)}"
                )
            if r.count == 0:
                raise SourceError(f"{where}: empty range for {r.tp}")
        for tp in (*self.new_partitions, *self.skipped):
            if tp not in start:
                raise SourceError(f"{where}: {tp} is not among the plan's partitions")
        object.__setattr__(self, "start_offsets", start)
        object.__setattr__(self, "ranges", ranges)
        object.__setattr__(
            self, "new_partitions", tuple(sorted(TopicPartition(*tp) for tp in self.new_partitions))
        )
        object.__setattr__(
            self, "skipped", {TopicPartition(*tp): int(n) for tp, n in sorted(self.skipped.items())}
        )

    @property
    def records(self) -> int:
        """Offsets this batch spans; an upper bound on records (gaps are possible)."""
        return sum(r.count for r in self.ranges)

    def end_offsets(self) -> dict[TopicPartition, int]:
        """The snapshot after this batch: every known partition, read ones advanced."""
        out = dict(self.start_offsets)
        for r in self.ranges:
            out[r.tp] = r.end
        return out

    def ranges_for_task(self, task: int, num_tasks: int) -> list[OffsetRange]:
        """The ranges source task ``task`` of ``num_tasks`` reads (Flink's assignment)."""
        if not 0 <= task < num_tasks:
            raise SourceError(f"source task {task} is out of range for parallelism {num_tasks}")
        return [r for r in self.ranges if source_task(r.topic, r.partition, num_tasks) == task]

    def to_json(self) -> dict[str, Any]:
        return {
            "pipeline": self.pipeline,
            "batch_id": self.batch_id,
            "start_offsets": snapshot_to_json(self.start_offsets),
            "ranges": [r.to_json() for r in self.ranges],
            "new_partitions": [list(tp) for tp in self.new_partitions],
            "until_timestamp_ms": self.until_timestamp_ms,
            "skipped": snapshot_to_json(self.skipped),
            "created_at": self.created_at,
            "reaches_until": self.reaches_until,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> BatchPlan:
        return cls(
            pipeline=data["pipeline"],
            batch_id=int(data["batch_id"]),
            start_offsets=snapshot_from_json(data["start_offsets"]),
            ranges=tuple(OffsetRange.from_json(r) for r in data["ranges"]),
            new_partitions=tuple(TopicPartition(t, int(p)) for t, p in data["new_partitions"]),
            until_timestamp_ms=data.get("until_timestamp_ms"),
            skipped=snapshot_from_json(data.get("skipped", {})),
            created_at=int(data.get("created_at", 0)),
            reaches_until=data.get("reaches_until"),
        )


def _current_partitions(
    view: BrokerView, topics: Collection[str], committed: Mapping[TopicPartition, int]
) -> list[TopicPartition]:
    """Every partition of ``topics`` now; fails if a topic or committed partition is gone."""
    out: list[TopicPartition] = []
    for topic in sorted(set(topics)):
        found = view.partitions_for(topic)
        had = sorted(tp.partition for tp in committed if tp.topic == topic)
        if not found:
            state = f"the last checkpoint has partitions {had}" if had else "it is required"
            raise SourceError(
                f"topic {topic!r} does not exist on {view.bootstrap_servers} ({state}). "
                "Create the topic, or remove it from the pipeline's topics."
            )
        gone = [p for p in had if p not in found]
        if gone:
            raise SourceError(
                f"topic {topic!r} on {view.bootstrap_servers} no longer has partition(s) "
                f"{gone} that the last checkpoint read (it has {sorted(found)}); the topic "
                "was probably deleted and recreated. Restore from a checkpoint that matches "
                "the topic, or start the pipeline afresh."
            )
        out += [TopicPartition(topic, p) for p in sorted(found)]
    return out


def plan_batch(
    view: BrokerView,
    *,
    pipeline: str,
    batch_id: int,
    topics: Collection[str],
    committed: Mapping[TopicPartition, int] | None,
    starting: StartingPosition,
    limits: BatchLimits,
    until_timestamp_ms: int | None = None,
    on_out_of_range: OnOutOfRange = "fail",
    now_ms: int | None = None,
) -> BatchPlan:
    """Decide the ranges of batch ``batch_id`` (see the module docstring for the rules).

    ``committed`` is the offset snapshot of the last checkpoint, ``None`` before the
    first. Committed partitions of topics no longer in ``topics`` are carried unchanged
    in the plan's snapshot, so re-adding a topic resumes where it stopped.
    """
    if on_out_of_range not in _ON_OUT_OF_RANGE:
        raise SourceError(
            f"on_out_of_range={on_out_of_range!r}: use one of {list(_ON_OUT_OF_RANGE)}"
        )
    if not topics:
        raise SourceError(f"pipeline {pipeline!r}: no topics to read")
    if until_timestamp_ms is not None and until_timestamp_ms < 0:
        raise SourceError(f"until_timestamp_ms must be ≥ 0, got {until_timestamp_ms}")
    first_batch = committed is None
    committed = {TopicPartition(*tp): int(o) for tp, o in (committed or {}).items()}
    tps = _current_partitions(view, topics, committed)
    begin = view.beginning_offsets(tps)
    end = view.end_offsets(tps)

    # Where each partition starts.
    start: dict[TopicPartition, int] = {}
    new = [tp for tp in tps if tp not in committed]
    position = (
        starting
        if first_batch
        else (starting if starting.kind == "timestamp" else StartingPosition.earliest())
    )
    found: dict[TopicPartition, int | None] = {}
    if position.timestamp_ms is not None and new:
        found = view.offsets_for_times(new, position.timestamp_ms)
    for tp in new:
        if position.kind == "earliest":
            start[tp] = begin[tp]
        elif position.kind == "latest":
            start[tp] = end[tp]
        else:
            hit = found.get(tp)
            start[tp] = end[tp] if hit is None else max(hit, begin[tp])

    skipped: dict[TopicPartition, int] = {}
    for tp in tps:
        if tp not in committed:
            continue
        wanted = committed[tp]
        if wanted > end[tp]:
            raise SourceError(
                f"{tp}: committed offset {wanted} is beyond the end offset {end[tp]} on "
                f"{view.bootstrap_servers} (pipeline {pipeline!r}, batch {batch_id}); the "
                "topic was probably deleted and recreated. Restore from a matching "
                "checkpoint or start the pipeline afresh."
            )
        if wanted < begin[tp]:
            if on_out_of_range == "fail":
                raise DataLossError(
                    f"{tp}: committed offset {wanted} is no longer available on "
                    f"{view.bootstrap_servers}; the earliest available offset is {begin[tp]} "
                    f"(retention deleted {begin[tp] - wanted} offsets before pipeline "
                    f"{pipeline!r} read them, batch {batch_id}). To skip them and continue "
                    'from the earliest offset, rerun with on_out_of_range="earliest"; to '
                    "avoid it, raise the topic's retention or run batches more often."
                )
            skipped[tp] = begin[tp] - wanted
            wanted = begin[tp]
        start[tp] = wanted

    # Where each partition stops: end (LSO), the data interval's end, then the limits.
    until = dict(end)
    if until_timestamp_ms is not None:
        for tp, hit in view.offsets_for_times(tps, until_timestamp_ms).items():
            if hit is not None:
                until[tp] = min(until[tp], hit)
    backlog = {tp: max(0, until[tp] - start[tp]) for tp in tps}
    allowed = limits.apply(backlog)
    ranges = tuple(
        OffsetRange(tp.topic, tp.partition, start[tp], start[tp] + allowed[tp])
        for tp in tps
        if allowed[tp] > 0
    )

    reaches_until = None
    if until_timestamp_ms is not None:
        reaches_until = all(start[tp] <= until[tp] and allowed[tp] == backlog[tp] for tp in tps)

    snapshot = {tp: o for tp, o in committed.items() if tp.topic not in set(topics)}
    snapshot.update(start)
    return BatchPlan(
        pipeline=pipeline,
        batch_id=batch_id,
        start_offsets=snapshot,
        ranges=ranges,
        new_partitions=tuple(new) if not first_batch else (),
        until_timestamp_ms=until_timestamp_ms,
        skipped=skipped,
        created_at=int(time.time() * 1000) if now_ms is None else now_ms,
        reaches_until=reaches_until,
    )


# --------------------------------------------------------------------------- storage


class PlanStore:
    """Plans at the layout's ``plans/<batch_id:020d>.json``, written once (exclusive create)."""

    def __init__(self, store: ObjectStore, prefix: str = "") -> None:
        self.store = store
        self.layout = Layout(prefix)

    def key(self, batch_id: int) -> str:
        return self.layout.plan_key(batch_id)

    def load(self, batch_id: int) -> BatchPlan | None:
        """The stored plan of ``batch_id``, or ``None`` if none was written."""
        try:
            data = self.store.get(self.key(batch_id))
        except ObjectNotFoundError:
            return None
        try:
            return BatchPlan.from_json(json.loads(data))
        except (ValueError, KeyError, TypeError) as exc:
            raise SourceError(
                f"plan {self.store.url}/{self.key(batch_id)} is corrupt: {exc!r}. Delete it "
                "only if no attempt of this batch committed."
            ) from exc

    def save(self, plan: BatchPlan) -> BatchPlan:
        """Write ``plan`` unless one exists; return the stored plan (the existing one wins).

        Returning the earlier plan is crash replay: a rerun reads what the first attempt
        was going to read, even if the broker has more records by now.
        """
        body = json.dumps(plan.to_json(), sort_keys=True, separators=(",", ":")).encode()
        try:
            self.store.create(self.key(plan.batch_id), body)
        except AlreadyExistsError:
            existing = self.load(plan.batch_id)
            if existing is None:  # deleted between create and get: try once more
                return self.save(plan)
            if existing.pipeline != plan.pipeline:
                raise SourceError(
                    f"plan {self.key(plan.batch_id)} in {self.store.url} belongs to pipeline "
                    f"{existing.pipeline!r}, not {plan.pipeline!r}: two pipelines share a prefix"
                ) from None
            return existing
        return plan

    def plan_or_replay(
        self,
        view: BrokerView,
        *,
        pipeline: str,
        topics: Collection[str],
        committed: Mapping[TopicPartition, int] | None,
        committed_batch_id: int | None,
        starting: StartingPosition,
        limits: BatchLimits,
        until_timestamp_ms: int | None = None,
        on_out_of_range: OnOutOfRange = "fail",
    ) -> BatchPlan:
        """The plan of the batch after ``committed_batch_id``: the stored one, else a new one.

        A stored plan must start where the committed snapshot ends (plus any recorded
        retention skips); otherwise the plan and the checkpoint disagree and the batch
        must not run.
        """
        batch_id = 0 if committed_batch_id is None else committed_batch_id + 1
        existing = self.load(batch_id)
        if existing is None:
            plan = plan_batch(
                view,
                pipeline=pipeline,
                batch_id=batch_id,
                topics=topics,
                committed=committed,
                starting=starting,
                limits=limits,
                until_timestamp_ms=until_timestamp_ms,
                on_out_of_range=on_out_of_range,
            )
            existing = self.save(plan)
        self.check_continues(existing, committed)
        return existing

    def replace(self, plan: BatchPlan) -> None:
        """Overwrite the stored plan of ``plan.batch_id``: only for a batch that cannot have
        committed (the caller holds the pipeline's lease and the checkpoint before it is
        the newest), when the stored plan's records are gone."""
        body = json.dumps(plan.to_json(), sort_keys=True, separators=(",", ":")).encode()
        self.store.put(self.key(plan.batch_id), body)

    def check_continues(
        self, plan: BatchPlan, committed: Mapping[TopicPartition, int] | None
    ) -> None:
        for tp, offset in (committed or {}).items():
            tp = TopicPartition(*tp)
            expected = offset + plan.skipped.get(tp, 0)
            if plan.start_offsets.get(tp) != expected:
                raise SourceError(
                    f"stored plan {self.key(plan.batch_id)} of pipeline {plan.pipeline!r} "
                    f"starts {tp} at {plan.start_offsets.get(tp)}, but the committed "
                    f"checkpoint is at {offset}: the plan belongs to a different history. "
                    "Check which checkpoint is the latest before deleting anything."
                )
