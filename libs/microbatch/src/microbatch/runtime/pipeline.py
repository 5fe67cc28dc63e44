"""A pipeline definition: source → (enrich) → key_by → keyed process → sinks.

Everything a batch needs is declared here and validated when the pipeline is built, so a
typo fails in the DAG file or CLI, not halfway through a batch::

    pipeline = Pipeline(
        name="clickstream",
        source=KafkaSource(topics=("clicks",), starting="earliest"),
        key_by="user_id",
        process=Sessionize(),
        event_time=EventTime(field="ts", allowed_lateness_s=60),
        sinks=(ParquetSink("sessions", "s3://bucket/sessions"),),
        dead_letters=DeadLetterSink(path="s3://bucket/dead-letters"),
        checkpoints="s3://bucket/checkpoints/clickstream",
        max_parallelism=128,
        parallelism=2,
    )

Records between stages are plain data (the state codec's types: dicts of str/int/float/
bool/None/lists ...), so they survive Arrow, checkpoints and reruns unchanged.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

from microbatch.errors import ConfigError
from microbatch.kafka.confluent_reader import librdkafka_config
from microbatch.keygroups import check_max_parallelism
from microbatch.runtime.column_plan import check_column_steps, check_sink_only, check_value_schema
from microbatch.runtime.columns import ColumnStep
from microbatch.runtime.consumer_config import check_consumer_config
from microbatch.runtime.graph import Edge, check_edges
from microbatch.runtime.process import KeyedProcessFunction
from microbatch.runtime.schema import ValueSchema
from microbatch.runtime.steps import KeyedStep, Stateless, Tap, check_steps, sink_only
from microbatch.runtime.tombstones import check_tombstones
from microbatch.sinks import DEAD_LETTER_SINK, DeadLetterSink, KafkaSink, ParquetSink, Sink
from microbatch.sinks.deadletters import check_sinks
from microbatch.validation import check_name, check_positive

__all__ = [
    "DEAD_LETTER_SINK",
    "DeadLetterSink",
    "Enrichment",
    "EventTime",
    "KafkaSink",
    "KafkaSource",
    "ParquetSink",
    "Pipeline",
    "check_parallelism_for",
    "json_decoder",
]

Decoder = Callable[[bytes], Any]
OnOutOfRange = Literal["fail", "earliest"]
KafkaReader = Literal["auto", "python", "spark", "confluent", "native"]
_READERS = ("auto", "python", "spark", "confluent", "native")
WatermarkRule = Literal["min_partition", "global_max"]
_WATERMARK_RULES = ("min_partition", "global_max")


def json_decoder(value: bytes) -> Any:
    """The default value decoder: UTF-8 JSON."""
    return json.loads(value)


@dataclasses.dataclass(frozen=True)
class KafkaSource:
    """Where records come from and how much one batch may read.

    ``starting`` applies to partitions without a committed offset: ``"earliest"``,
    ``"latest"`` or an epoch-milliseconds timestamp (int). ``max_records_per_partition``
    and ``max_records_per_batch`` cap one batch (like Spark's ``maxOffsetsPerTrigger``).
    ``on_out_of_range``: what to do when committed offsets were deleted by retention —
    ``"fail"`` (default) or ``"earliest"`` (skip ahead; the skipped count is in the stats).

    ``reader``: what reads the planned offset ranges in stage 1 — ``"spark"``, Spark's own
    Kafka source in the JVM (``spark-sql-kafka-0-10`` must be on the session's classpath;
    several times less CPU per record), ``"python"``, kafka-python inside the stage-1
    tasks, ``"confluent"``, confluent-kafka (librdkafka) inside the stage-1 tasks (needs
    the ``confluent-kafka`` package on the executors), ``"native"``, microbatch's native
    reader (librdkafka into Arrow columns in Rust, the least CPU per record: a quarter of
    confluent-kafka's; needs the ``microbatch-native`` extension on the executors, plain or
    SASL/PLAIN connections), or ``"auto"`` (default): the native reader where it is
    installed and can connect, else confluent-kafka unless ``consumer_config`` holds a
    setting librdkafka lacks, then the JVM source when the session has the connector,
    else kafka-python. All read exactly the same records.

    ``value_schema``: the values' declared schema (:class:`~microbatch.runtime.schema.
    JsonSchema`), instead of ``decoder``. Values are then decoded into Arrow columns, a
    batch at a time; records hold the declared fields only, and a value that does not
    match is a dead letter ``schema_mismatch`` naming the field (``docs/kafka-source.md``).

    ``tombstones``: a record with a null value (a compacted or changelog topic's delete)
    reaches the pipeline as a ``None`` record keyed by its Kafka key, read by
    ``tombstone_key(key_bytes)`` (default: the bytes as UTF-8 text), instead of being a
    dead letter ``undecodable``. Only the table side of a
    :class:`~microbatch.joins.TableJoin` takes them (``docs/joins.md``).

    ``consumer_config``: Kafka consumer settings in kafka-python's names (such as
    ``fetch_max_wait_ms``), for any reader (:mod:`microbatch.runtime.consumer_config`;
    ``"confluent"`` and ``"native"`` refuse those librdkafka has no setting for, such as
    ``max_poll_records``);
    security is the deployment's (:class:`~microbatch.settings.Settings`), not here.
    """

    topics: Sequence[str]
    starting: str | int = "earliest"
    max_records_per_partition: int | None = None
    max_records_per_batch: int | None = None
    on_out_of_range: OnOutOfRange = "fail"
    decoder: Decoder = json_decoder
    reader: KafkaReader = "auto"
    value_schema: ValueSchema | None = None
    tombstones: bool = False
    tombstone_key: Callable[[bytes], Any] | None = None
    consumer_config: Mapping[str, Any] | None = dataclasses.field(default=None, hash=False)

    def __post_init__(self) -> None:
        if isinstance(self.topics, str):
            object.__setattr__(self, "topics", (self.topics,))
        object.__setattr__(self, "topics", tuple(self.topics))
        if not self.topics:
            raise ConfigError("KafkaSource needs at least one topic")
        for t in self.topics:
            check_name("topic", t)
        if self.starting not in ("earliest", "latest") and (
            isinstance(self.starting, bool) or not isinstance(self.starting, int)
        ):
            raise ConfigError(
                f"KafkaSource starting must be 'earliest', 'latest' or an epoch-ms int, "
                f"got {self.starting!r}"
            )
        check_positive("max_records_per_partition", self.max_records_per_partition)
        check_positive("max_records_per_batch", self.max_records_per_batch)
        if self.on_out_of_range not in ("fail", "earliest"):
            raise ConfigError(
                f"on_out_of_range must be 'fail' or 'earliest', got {self.on_out_of_range!r}"
            )
        if not callable(self.decoder):
            raise ConfigError(f"KafkaSource decoder must be callable, got {self.decoder!r}")
        if self.value_schema is not None:
            if not hasattr(self.value_schema, "decode") or not hasattr(
                self.value_schema, "arrow_schema"
            ):
                raise ConfigError(
                    "KafkaSource value_schema must be a declared schema such as "
                    f"JsonSchema({{'user_id': 'string', 'ts': 'long'}}), got {self.value_schema!r}"
                )
            if self.decoder is not json_decoder:
                raise ConfigError(
                    "KafkaSource takes a decoder or a value_schema, not both: the schema "
                    "decodes the values"
                )
        if self.reader not in _READERS:
            raise ConfigError(
                f"KafkaSource reader must be one of {', '.join(map(repr, _READERS))} (what "
                f"reads Kafka in stage 1), got {self.reader!r}"
            )
        if not isinstance(self.tombstones, bool):
            raise ConfigError(f"KafkaSource tombstones must be True or False: {self.tombstones!r}")
        if self.tombstone_key is not None and not (
            self.tombstones and callable(self.tombstone_key)
        ):
            raise ConfigError(
                "KafkaSource tombstone_key reads a tombstone's Kafka key: it needs "
                f"tombstones=True and a function of the key bytes, got {self.tombstone_key!r}"
            )
        where = f"KafkaSource of {list(self.topics)}"
        config = check_consumer_config(where, self.consumer_config)
        if self.reader in ("confluent", "native"):
            librdkafka_config(config, where=where)
        object.__setattr__(self, "consumer_config", config or None)

    def key_of_tombstone(self, kafka_key: bytes | None) -> Any:
        """The join key of a tombstone with this Kafka key (None: it has none)."""
        if kafka_key is None:
            return None
        if self.tombstone_key is None:
            return kafka_key.decode("utf-8")
        return self.tombstone_key(kafka_key)


@dataclasses.dataclass(frozen=True)
class Enrichment:
    """Async I/O enrichment of each decoded record (see ``microbatch.enrich``).

    ``make_operator`` is a picklable zero-argument callable (a module-level function or a
    ``functools.partial``) returning a fresh ``AsyncOperator``: it runs inside Spark tasks.
    ``deadline_s``: how long each task of a batch may spend enriching (from its start);
    elements not done by then move to the next batch's checkpoint instead of delaying the
    commit.
    """

    make_operator: Callable[[], Any]
    deadline_s: float | None = None

    def __post_init__(self) -> None:
        if not callable(self.make_operator):
            raise ConfigError(f"Enrichment make_operator must be callable: {self.make_operator!r}")
        check_positive("Enrichment deadline_s", self.deadline_s)


@dataclasses.dataclass(frozen=True)
class EventTime:
    """Event-time watermarks.

    ``field``: the record field holding the event time (epoch ms int, or an ISO-8601
    string). ``watermark`` chooses how the pipeline's watermark follows the source:

    - ``"min_partition"`` (the default, Flink's rule): the watermark of a source partition
      is the largest event time seen in it minus ``allowed_lateness_s``; the pipeline's is
      the minimum over partitions that are not idle (no record for ``idle_timeout_s`` of
      processing time);
    - ``"global_max"`` (Spark Structured Streaming's ``withWatermark``): the largest event
      time seen in the whole stream minus ``allowed_lateness_s``; partitions and
      ``idle_timeout_s`` play no part. A partition that lags the others loses its records
      to lateness, as in Spark.

    Records older than the watermark at the start of their batch are late and go to the
    dead letters; windows instead decide by window (``microbatch.windows``).
    """

    field: str
    allowed_lateness_s: float = 0.0
    idle_timeout_s: float | None = 300.0
    watermark: WatermarkRule = "min_partition"

    def __post_init__(self) -> None:
        if not isinstance(self.field, str) or not self.field:
            raise ConfigError(f"EventTime field must be a record field name: {self.field!r}")
        if isinstance(self.allowed_lateness_s, bool) or not self.allowed_lateness_s >= 0:
            raise ConfigError(f"allowed_lateness_s must be >= 0: {self.allowed_lateness_s!r}")
        check_positive("idle_timeout_s", self.idle_timeout_s)
        if self.watermark not in _WATERMARK_RULES:
            raise ConfigError(
                f"EventTime watermark must be one of {', '.join(map(repr, _WATERMARK_RULES))}: "
                f"{self.watermark!r}"
            )


OnProcessError = Literal["fail", "dead_letter"]


@dataclasses.dataclass(frozen=True)
class Pipeline:
    """One pipeline: its name is its identity (checkpoints, consumer groups, lease)."""

    name: str
    source: KafkaSource
    process: KeyedProcessFunction
    checkpoints: str
    key_by: str | Callable[[Any], Any] | None = None
    sinks: Sequence[Sink] = ()
    dead_letters: DeadLetterSink | None = None
    enrich: Enrichment | None = None
    event_time: EventTime | None = None
    max_parallelism: int = 128
    parallelism: int = 1
    on_process_error: OnProcessError = "fail"
    retain_checkpoints: int = 10
    #: No longer used: state lives in sorted runs, whose merges (size tiers) bound how many
    #: runs a read asks. Kept so job files that set it still load.
    full_checkpoint_every: int = 10
    #: How long a run that stopped renewing (died, stalled) keeps the pipeline from others.
    lease_timeout_s: float = 60.0
    #: A dataflow's parts (:mod:`microbatch.runtime.steps`; built by
    #: :class:`microbatch.dataflow.Dataflow`): stateless steps before the first key, the
    #: first keyed step's uid and where its output goes (None: to every sink), and the
    #: further keyed steps in order.
    prefix: Sequence[Stateless] = ()
    uid: str | None = None
    taps: Sequence[Tap] | None = None
    steps: Sequence[KeyedStep] = ()
    #: Further keyed steps whose state may be dropped: removed from the dataflow, or
    #: given a function of another class (whose state would not fit). Without it, either
    #: is refused, naming the step.
    drop_state: Sequence[str] = ()
    #: Several sources (a dataflow's ``union``): each with its own decoding and stateless
    #: steps before the first key; ``source`` is then what they read together (every
    #: topic, their shared starting position and limits) and ``prefix`` is empty.
    inputs: Sequence[Input] = ()
    #: Sinks fed before the first keyed step, each through its own stateless steps (one
    #: source only); the first step's instances stage them.
    source_taps: Sequence[Tap] = ()
    #: A dataflow that is not a chain (branches, unions after a keyed step, a source
    #: feeding a later step, joins): every keyed step's inputs
    #: (:class:`~microbatch.runtime.graph.Edge`), replacing ``prefix``, the inputs'
    #: prefixes and the steps' ``before``; empty for a chain.
    edges: Sequence[Edge] = ()
    #: Column-wise steps (``where``/``select``, :mod:`microbatch.runtime.columns`) on the
    #: declared schema's columns, before the first key and before ``prefix``: one source
    #: with a ``value_schema``, no enrichment; in a chain the records then travel as
    #: columns, in a graph (``edges``) they are built from the kept columns in stage 1.
    #: Several sources carry theirs in :attr:`Input.columns`.
    column_steps: Sequence[ColumnStep] = ()

    def __post_init__(self) -> None:
        check_name("pipeline", self.name)
        object.__setattr__(self, "sinks", tuple(self.sinks))
        object.__setattr__(self, "prefix", tuple(self.prefix))
        object.__setattr__(self, "steps", tuple(self.steps))
        object.__setattr__(self, "drop_state", tuple(self.drop_state))
        object.__setattr__(self, "inputs", tuple(self.inputs))
        object.__setattr__(self, "source_taps", tuple(self.source_taps))
        object.__setattr__(self, "edges", tuple(self.edges))
        object.__setattr__(self, "column_steps", tuple(self.column_steps))
        check_inputs(self)
        check_column_steps(self)
        if self.taps is not None:
            object.__setattr__(self, "taps", tuple(self.taps))
        where = f"pipeline {self.name!r}"
        if not isinstance(self.source, KafkaSource):
            raise ConfigError(f"{where}: source must be a KafkaSource, got {self.source!r}")
        if not isinstance(self.process, KeyedProcessFunction):
            raise ConfigError(
                f"{where}: process must be a KeyedProcessFunction instance, got {self.process!r}"
            )
        if getattr(self.process, "columnar", False) and self.event_time is None:
            raise ConfigError(
                f"{where}: windows need event time: set event_time=EventTime(field=...) to the "
                "record field holding each record's time"
            )
        if self.key_by is None and not sink_only(self):
            raise ConfigError(
                f"{where}: key_by is missing; keyed state needs a key (a field name or a "
                "function of the record)"
            )
        if sink_only(self):
            check_sink_only(self, where)
        elif not (isinstance(self.key_by, str) and self.key_by) and not callable(self.key_by):
            raise ConfigError(f"{where}: key_by must be a field name or callable: {self.key_by!r}")
        if not self.checkpoints:
            raise ConfigError(f"{where}: checkpoints location is empty")
        try:
            check_max_parallelism(self.max_parallelism)
        except Exception as e:
            raise ConfigError(f"{where}: {e}") from None
        check_parallelism_for(self, self.parallelism)
        check_sinks(where, self.sinks, self.dead_letters)
        check_steps(
            where,
            self.uid,
            self.taps,
            self.steps,
            (s.name for s in self.sinks),
            self.event_time is not None,
            self.source_taps,
        )
        check_edges(self, where)
        check_tombstones(self, where)
        check_value_schema(self)
        if self.on_process_error not in ("fail", "dead_letter"):
            raise ConfigError(
                f"{where}: on_process_error must be 'fail' or 'dead_letter', "
                f"got {self.on_process_error!r}"
            )
        if self.on_process_error == "dead_letter" and self.dead_letters is None:
            raise ConfigError(f"{where}: on_process_error='dead_letter' needs dead_letters=")
        if not isinstance(self.retain_checkpoints, int) or self.retain_checkpoints < 1:
            raise ConfigError(f"{where}: retain_checkpoints must be >= 1")
        check_positive(f"{where}: lease_timeout_s", self.lease_timeout_s, allow_none=False)

    def all_sinks(self) -> tuple[Sink, ...]:
        """User sinks plus the dead-letter sink, in a fixed order."""
        extra = (self.dead_letters,) if self.dead_letters is not None else ()
        return tuple(self.sinks) + extra

    def sink(self, name: str) -> Sink:
        for s in self.all_sinks():
            if s.name == name:
                return s
        raise ConfigError(f"pipeline {self.name!r} has no sink {name!r}")

    @property
    def keyed_uids(self) -> tuple[str, ...]:
        """The uids of the keyed steps, first to last (the first's may be unset: "")."""
        return (self.uid or "", *(s.uid for s in self.steps))

    def step_types(self) -> dict[str, str]:
        """The class of each further keyed step's function, by uid."""
        return {s.uid: type_name(s.process) for s in self.steps}

    def key_of(self, record: Any) -> Any:
        if callable(self.key_by):
            return self.key_by(record)
        return record.get(self.key_by) if isinstance(record, Mapping) else None

    def fingerprint(self) -> str:
        """What must not change between checkpoints: the name, the process class.

        (``max_parallelism`` is checked on its own: changing it needs ``microbatch
        reshard``. Topics may be added; a removed topic keeps its offsets.)"""
        parts = {"name": self.name, "process": type_name(self.process)}
        return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]


@dataclasses.dataclass(frozen=True)
class Input:
    """One of several sources: how its records are decoded (its ``KafkaSource``'s
    ``decoder`` or ``value_schema``) and the stateless steps they go through before the
    first keyed step; ``columns``: column steps (``where``/``select``) on its declared
    schema's columns, before its records are built
    (:func:`~microbatch.runtime.column_plan.record_column_steps`)."""

    source: KafkaSource
    prefix: tuple[Stateless, ...] = ()
    columns: tuple[ColumnStep, ...] = ()


#: What several sources must agree on: one plan reads them together.
_SHARED = ("starting", "max_records_per_partition", "max_records_per_batch",
           "on_out_of_range", "reader", "consumer_config")  # fmt: skip


def combined_source(sources: Sequence[KafkaSource], where: str) -> KafkaSource:
    """The one KafkaSource that several read as: every topic once, the shared settings."""
    first = sources[0]
    topics: list[str] = []
    for src in sources:
        for name in _SHARED:
            if getattr(src, name) != getattr(first, name):
                raise ConfigError(
                    f"{where}: the sources of topics {list(first.topics)} and "
                    f"{list(src.topics)} differ in {name} ({getattr(first, name)!r} vs "
                    f"{getattr(src, name)!r}); several sources read in one plan must agree"
                )
        for t in src.topics:
            if t in topics:
                raise ConfigError(f"{where}: topic {t!r} is read by two sources; read it once")
            topics.append(t)
    return dataclasses.replace(
        first,
        topics=tuple(topics),
        decoder=json_decoder,
        value_schema=None,
        tombstones=False,  # each input's own: see check_tombstones
        tombstone_key=None,
    )


def check_inputs(pipeline: Pipeline) -> None:
    if not pipeline.inputs:
        return
    where = f"pipeline {pipeline.name!r}"
    if pipeline.prefix:
        raise ConfigError(f"{where}: with several inputs, each input has its own prefix")
    if any(t.source is None for t in pipeline.source_taps):
        raise ConfigError(
            f"{where}: with several inputs, a sink before the first keyed step takes the "
            "records of one (Tap.source)"
        )
    if pipeline.enrich is not None:
        raise ConfigError(f"{where}: enrichment of several sources is not supported yet")
    combined = combined_source([i.source for i in pipeline.inputs], where)
    if pipeline.source.topics != combined.topics:
        raise ConfigError(
            f"{where}: source must read the inputs' topics {list(combined.topics)}, "
            f"not {list(pipeline.source.topics)}"
        )


def input_of(pipeline: Pipeline) -> dict[str, Input]:
    """Each topic's input (empty for a single source)."""
    return {t: i for i in pipeline.inputs for t in i.source.topics}


def type_name(obj: Any) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def check_parallelism_for(pipeline: Pipeline, parallelism: int) -> int:
    if (
        isinstance(parallelism, bool)
        or not isinstance(parallelism, int)
        or not 1 <= parallelism <= pipeline.max_parallelism
    ):
        raise ConfigError(
            f"pipeline {pipeline.name!r}: parallelism must be 1..max_parallelism "
            f"({pipeline.max_parallelism}), got {parallelism!r}"
        )
    return parallelism
