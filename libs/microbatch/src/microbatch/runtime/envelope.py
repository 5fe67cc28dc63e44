"""Stage 1 of a batch, inside Spark tasks: Kafka rows → decoded, keyed records.

Each Kafka record becomes one *envelope* row: either a ``record`` (decoded value, its key,
key-group, operator instance and event time) or a ``dead_letter`` (reason, error and the
raw bytes), never both, never neither — so nothing is lost and nothing doubled here.

Dead-letter reasons: ``undecodable`` (the decoder raised), ``missing_key`` /
``bad_key`` (key_by gave None or a type keys cannot have), ``missing_event_time`` /
``bad_event_time``, ``late`` (event time behind the watermark the batch started with),
``enrichment_timeout`` / ``enrichment_error`` / ``enrichment_invalid_result`` (the
async operator dead-lettered it, with its attempt count).

A record's ``payload`` is what stage 2 decodes back into the record: its source bytes
when no enrichment ran (the source decoder reads them again), else the enriched value in
the *envelope payload* format of :func:`encode_payload`. A pipeline with a declared value
schema and no enrichment carries no payload: its envelope has one more column per
declared field (:func:`envelope_schema`, named ``value_<field>``), filled by stage 1's
decoded columns and read by stage 2 as columns (``schema_mismatch`` dead letters name
the field that did not match). A dead letter's ``payload`` holds
its :class:`DeadLetterDetail` in the same format: dead letters are rare, so the envelope
carries no columns only they would fill (each one costs every row in the stage-2 shuffle).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from operator import itemgetter
from typing import Any, NamedTuple, cast

import pyarrow as pa
import pyarrow.compute as pc

from microbatch.runtime.records import PartitionCounts, StageOneTotals, TotalsTally
from microbatch.runtime.steps import FOR
from microbatch.runtime.watermark import partition_name
from microbatch.state.codec import decode_value, decode_values, encode_value, encode_values

ENVELOPE_SCHEMA = pa.schema(
    [
        ("kind", pa.string()),
        ("topic", pa.string()),
        ("partition", pa.int32()),
        ("offset", pa.int64()),
        ("seq", pa.int32()),
        ("instance", pa.int32()),
        ("key_group", pa.int32()),
        ("key", pa.binary()),
        ("event_ts", pa.int64()),
        ("payload", pa.binary()),
    ]
)
#: Prefix of the envelope columns holding a declared schema's fields.
VALUE_PREFIX = "value_"  # no dot: Spark would read one as a struct field


def envelope_schema(values: pa.Schema | None = None) -> pa.Schema:
    """The envelope's schema: :data:`ENVELOPE_SCHEMA`, plus a nullable ``value_<field>``
    column per field of ``values`` (the declared schema's columns) when given."""
    if values is None:
        return ENVELOPE_SCHEMA
    extra = [pa.field(VALUE_PREFIX + f.name, f.type) for f in values]
    return pa.schema([*ENVELOPE_SCHEMA, *extra])


def value_columns(table: pa.Table, values: pa.Schema) -> pa.Table:
    """The declared fields' columns of envelope rows, under the fields' own names."""
    return table.select([VALUE_PREFIX + f.name for f in values]).rename_columns(values.names)


RECORD = "record"
DEAD_LETTER = "dead_letter"
#: A window's partial aggregate of one stage-1 task's records of one (key, window): its
#: columns are the ``partial_*`` ones of ``runtime.windowed.exchange_schema``.
PARTIAL = "partial"
#: An enrichment input not finished by the batch deadline; ``payload`` is the pending
#: element, carried to the next batch through the checkpoint.
PENDING = "pending"
#: What a stage-1 task saw of one source partition (``payload``: its
#: :class:`PartitionStats`), one copy per operator instance: stage 1 and stage 2 run as
#: one Spark job, so every instance learns the batch's counts and event times from these
#: rows and computes the batch watermark itself, before its timers fire.
STAT = "stat"
#: The Kafka columns stage 1 reads (of ``KAFKA_SCHEMA``): a reader may send only these.
SOURCE_COLUMNS = ("topic", "partition", "offset", "key", "value")
#: One per instance: what makes an instance run, and fire its due timers, without input.
TICK = "tick"
#: A keyed step instance's result on its way to the driver through the later exchanges
#: of a dataflow (``topic``: the step's uid, "" for the first; ``payload``: its JSON).
RESULT = "result"
#: A record for a sink fed before the first keyed step (a dataflow's source tap): ``key``
#: holds the sink's name, ``payload`` the record; the first step's instance stages it.
OUTPUT = "output"
#: Records for the next keyed step packed as one Arrow IPC stream of their envelope rows
#: (``payload``), all for one ``instance`` (:mod:`microbatch.runtime.packed`).
PACKED = "packed"


class DeadLetterDetail(NamedTuple):
    """What a dead-letter envelope row carries in its ``payload``."""

    reason: str
    error: str
    raw_key: bytes | None
    raw_value: bytes | None
    attempts: int | None = None
    #: The uid of the keyed step that set the record aside (None: stage 1, before any).
    step: str | None = None

    def to_payload(self) -> bytes:
        return encode_payload(tuple(self))

    @classmethod
    def from_payload(cls, payload: bytes) -> DeadLetterDetail:
        return cls(*decode_payload(payload))


class PartitionStats(NamedTuple):
    """What one stage-1 task saw of one source partition (a ``stat`` row's payload)."""

    inputs: int  # Kafka records consumed (re-issued pending elements are not inputs)
    records: int
    dead_letters: int
    pending: int
    max_event: int | None  # largest event time among its records
    #: Sums of the source offsets of its records, dead letters and pending rows: which
    #: inputs became what, not only how many (a re-run task whose enrichment finished other
    #: elements by its deadline has the same counts, not the same sums).
    offset_sums: tuple[int, int, int] = (0, 0, 0)


def stage_one_totals(stats: Iterable[tuple[str, int, PartitionStats]]) -> StageOneTotals:
    """The batch's stage-1 counts from the (topic, partition, stats) of every task: totals,
    per-partition counts, and the max event time per partition (what the watermark
    advances by). A partition may be split over several tasks: counts add up, event
    times take the max. Stage 2 computes this in every instance; the driver checks that
    all instances agree."""
    tally = TotalsTally()
    for topic, part, s in stats:
        counts = PartitionCounts(s.inputs, s.records, s.dead_letters)
        tally.add(partition_name(topic, part), counts, s.pending, s.max_event, s.offset_sums)
    return tally.totals()


def encode_payload(value: Any) -> bytes:
    """A record as envelope payload bytes, for a later stage of the same batch: its state
    codec encoding (``CodecError`` for anything the codec refuses), so a record comes back
    exactly as from state — at C speed for plain data (MessagePack behind its tag)."""
    return encode_value(value)


def decode_payload(data: bytes) -> Any:
    """Inverse of :func:`encode_payload`."""
    return decode_value(data)


def encode_payloads(values: Sequence[Any]) -> list[bytes]:
    """:func:`encode_payload` of each value, a run of plain records packed in one go."""
    return encode_values(values)


def decode_payloads(datas: Sequence[bytes]) -> list[Any]:
    """:func:`decode_payload` of each payload, a run of them unpacked in one go."""
    return decode_values(datas)


def unkeyed_instance(part: int, off: int, parallelism: int) -> int:
    """The operator instance of a row without a key (a dead letter, a pending element):
    spread by source position, the same on every rerun."""
    return (part + off) % parallelism


class EnvelopeBuilder:
    """Envelope rows in arrival order, made into one Arrow batch at the end; ``schema``
    (:func:`envelope_schema`): columns beyond :data:`ENVELOPE_SCHEMA`'s are null in the
    rows added here."""

    def __init__(self, schema: pa.Schema = ENVELOPE_SCHEMA) -> None:
        self.rows: list[tuple[Any, ...]] = []
        self.schema = schema
        #: Rows the ``stat`` rows count but the output does not hold: records a window's
        #: partials stand for (``runtime.graph_partials``).
        self.counted: list[pa.RecordBatch] = []

    def add(
        self,
        kind: str,
        # topic, part, off: None for a dead letter of no source record (a failed timer's)
        # forwarded to a later step.
        topic: str | None,
        part: int | None,
        off: int | None,
        seq: int,
        instance: int,
        kg: int | None,
        key: bytes | None,
        ts: int | None,
        payload: bytes | None,
    ) -> None:
        self.rows.append((kind, topic, part, off, seq, instance, kg, key, ts, payload))

    def record(self, topic: str, part: int, off: int, seq: int, instance: int, kg: int,
               key: bytes, ts: int | None, payload: bytes) -> None:  # fmt: skip
        """A keyed record row (the hot path of :meth:`add`)."""
        self.rows.append((RECORD, topic, part, off, seq, instance, kg, key, ts, payload))

    def dead(
        self,
        topic: str,
        part: int,
        off: int,
        parallelism: int,
        reason: str,
        error: str,
        raw_key: bytes | None,
        raw_value: bytes | None,
        attempts: int | None = None,
        seq: int = 0,
    ) -> None:
        """A dead letter, routed to a deterministic instance that stages it."""
        inst = unkeyed_instance(part, off, parallelism)
        detail = DeadLetterDetail(reason, error, raw_key, raw_value, attempts).to_payload()
        self.add(DEAD_LETTER, topic, part, off, seq, inst, None, None, None, detail)

    def build(
        self,
        inputs: Counter[tuple[str, int]],
        parallelism: int,
        records: pa.RecordBatch | None = None,
    ) -> pa.RecordBatch:
        """The rows as one Arrow batch (after ``records``, rows built as columns), followed
        by the ``stat`` rows of every source partition seen (``inputs``: records consumed
        per partition), one per instance."""
        rows = self.rows_batch()
        if records is not None:
            rows = pa.concat_batches([records, rows])
        counted = pa.concat_batches([rows, *self.counted]) if self.counted else rows
        stats = _stat_rows(counted, inputs, parallelism, self.schema)
        return pa.concat_batches([rows, stats])

    def rows_batch(self) -> pa.RecordBatch:
        n = len(ENVELOPE_SCHEMA)
        # A column at a time: ``zip(*rows)`` costs twice as much on a task's rows.
        columns = [list(map(itemgetter(i), self.rows)) for i in range(n)]
        arrays = [pa.array(c, f.type) for c, f in zip(columns, ENVELOPE_SCHEMA, strict=True)]
        arrays += [pa.nulls(len(self.rows), f.type) for f in list(self.schema)[n:]]
        return pa.RecordBatch.from_arrays(arrays, schema=self.schema)


def _stat_rows(
    rows: pa.RecordBatch,
    inputs: Counter[tuple[str, int]],
    parallelism: int,
    schema: pa.Schema = ENVELOPE_SCHEMA,
) -> pa.RecordBatch:
    """The :class:`PartitionStats` of ``rows`` per source partition, counted by Arrow (the
    hot path adds rows without counting), as ``stat`` rows for every instance."""
    counts: dict[tuple[str, int], dict[str, int]] = {tp: {} for tp in inputs}
    top: dict[tuple[str, int], int | None] = {}
    table = pa.Table.from_batches([rows])
    topics = table.column("topic")
    if pc.any(pc.match_substring(topics, FOR)).as_py():  # rows for a later step: by source
        source = pc.replace_substring_regex(topics, f"{FOR}.*$", "")
        table = table.set_column(table.schema.get_field_index("topic"), "topic", source)
    grouped = table.group_by(["topic", "partition", "kind"], use_threads=False).aggregate(
        [("offset", "count"), ("offset", "sum"), ("event_ts", "max")]
    )
    sums: dict[tuple[str, int], dict[str, int]] = {}
    for g in grouped.to_pylist():
        tp = (g["topic"], g["partition"])
        counts.setdefault(tp, {})[g["kind"]] = g["offset_count"]
        sums.setdefault(tp, {})[g["kind"]] = g["offset_sum"] or 0
        if g["kind"] == RECORD:
            top[tp] = g["event_ts_max"]
    stat = EnvelopeBuilder(schema)
    for (topic, part), n in sorted(counts.items()):
        payload = encode_payload(
            tuple(
                PartitionStats(
                    inputs.get((topic, part), 0),
                    n.get(RECORD, 0),
                    n.get(DEAD_LETTER, 0),
                    n.get(PENDING, 0),
                    top.get((topic, part)),
                    cast(
                        "tuple[int, int, int]",
                        tuple(
                            sums.get((topic, part), {}).get(k, 0)
                            for k in (RECORD, DEAD_LETTER, PENDING)
                        ),
                    ),
                )
            )
        )
        for instance in range(parallelism):
            stat.add(STAT, topic, part, 0, 0, instance, None, None, None, payload)
    return stat.rows_batch()


def partition_stats(payload: bytes) -> PartitionStats:
    """A ``stat`` row's payload back as :class:`PartitionStats`."""
    return PartitionStats(*decode_payload(payload))


def ticks(instances: Iterable[int], schema: pa.Schema = ENVELOPE_SCHEMA) -> pa.Table:
    """One ``tick`` row per instance (``schema``: the pipeline's :func:`envelope_schema`)."""
    instances = list(instances)
    cols: dict[str, list[Any]] = {f.name: [None] * len(instances) for f in schema}
    cols["kind"] = [TICK] * len(instances)
    cols["instance"] = instances
    return pa.Table.from_pydict(cols, schema=schema)
