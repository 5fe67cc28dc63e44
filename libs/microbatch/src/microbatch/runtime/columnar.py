"""Records as columns, for pipelines with a declared value schema and no enrichment.

Stage 1 (:func:`columnar_envelopes`): a Kafka batch's values are decoded by the schema
into Arrow columns (:mod:`.schema`); key bytes and key-groups are computed once per
distinct key of the batch (a dictionary encoding of the key column, then ``take``);
event times are a column cast; records become envelope rows carrying the decoded columns
(``value_<field>``) and no payload. Python touches single rows only where a row is bad
or unusual — a value that does not match the schema, a null key or event time, an
ISO-8601 event time, a late record — and then goes through the very code the
per-record path uses (``StageOne.keyed``), so errors read the same.

Stage 2 (:class:`LazyRecords`): a key's records are taken from the columns and built
only when ``process()`` reads them; ``len(records)`` takes and builds none.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Collection, Iterator, Sequence
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from microbatch.errors import ProcessError
from microbatch.keygroup_columns import key_groups_of
from microbatch.runtime.column_plan import column_values, columnar_values, columns_read_by
from microbatch.runtime.columns import ColumnStep, ColumnStepFailed, run_columns
from microbatch.runtime.envelope import (
    RECORD,
    SOURCE_COLUMNS,
    VALUE_PREFIX,
    EnvelopeBuilder,
    envelope_schema,
    value_columns,
)
from microbatch.runtime.pipeline import Pipeline
from microbatch.runtime.schema import SCHEMA_MISMATCH, ValueSchema, kind_of

if TYPE_CHECKING:
    from microbatch.runtime.stage_one import StageOne

_NUMERIC_TIME = ("long", "int", "double")


def columnar_envelopes(stage: StageOne, batch: pa.RecordBatch) -> pa.RecordBatch:
    """Kafka rows (:data:`SOURCE_COLUMNS`) → envelope rows with the decoded columns."""
    from microbatch.runtime.stage_one import _Bad  # the per-record path's verdicts

    pipeline = stage.pipeline
    values = columnar_values(pipeline)  # after the column steps
    out = EnvelopeBuilder(envelope_schema(values))
    topic, part, off, _, rvalue = (batch.column(c) for c in SOURCE_COLUMNS)
    # pre-aggregating, the records' other fields go no further than this task: without
    # column steps, only the fields the window, the key and the event time read are built
    read = _window_fields(pipeline) if stage.pre_aggregate else None
    schema = cast(ValueSchema, pipeline.source.value_schema)
    projected = None if read is None or pipeline.column_steps else _keyed_fields(pipeline, read)
    if projected is None:
        table, rows, dead = decoded_values(pipeline, rvalue)
    else:
        table, rows, dead = decode_values(schema, rvalue, projected)
    if pipeline.column_steps:  # where() drops rows before they are keyed: no dead letter
        table, rows = column_steps(stage, pipeline.column_steps, table, rows, batch)

    key_bytes, key_groups, slow = keys_of(stage, table.column(pipeline.key_by))
    ts = event_times_of(stage, table, slow, stage._late_before)
    ok = np.ones(len(rows), dtype=bool)
    for i in np.nonzero(slow)[0].tolist():  # rare: through the per-record checks
        record = table.slice(i, 1).to_pylist()[0]
        try:
            _, _, t = stage.keyed(record)  # the key, if any, is the one computed already
        except _Bad as bad:
            dead[int(rows[i])] = (bad.reason, bad.error)
            ok[i] = False
            continue
        if ts is not None:
            ts[i] = t
    keep = np.nonzero(ok)[0]
    n = len(keep)
    take = pa.array(rows[keep])
    kgs = key_groups[keep].astype(np.int32)
    instance_of = np.asarray(stage._instance_of, dtype=np.int32)
    columns = [
        pa.repeat(RECORD, n),
        topic.take(take),
        part.take(take),
        off.take(take),
        pa.array(np.zeros(n, dtype=np.int32)),
        pa.array(instance_of[kgs]),
        pa.array(kgs),
        key_bytes.take(pa.array(keep)),
        pa.nulls(n, pa.int64()) if ts is None else pa.array(ts[keep], pa.int64()),
        pa.nulls(n, pa.binary()),
        *(table.column(f.name).take(pa.array(keep)).combine_chunks()
          if read is None or f.name in read else pa.nulls(n, f.type) for f in values),
    ]  # fmt: skip
    records = pa.RecordBatch.from_arrays(columns, schema=out.schema)
    add_dead_letters(out, dead, batch, stage.parallelism)
    built = out.build(
        consumed_per_partition(topic, part), stage.parallelism, records
    )  # stats: of records
    if not stage.pre_aggregate:
        return built

    def late_fields(at: pa.Array) -> pa.Table:  # every field, for the dead letters
        if projected is not None:  # decoded again, whole: the same values (late only)
            return decode_values(schema, rvalue.take(pa.array(rows[keep]).take(at)))[0]
        return table.select(values.names).take(pa.array(keep).take(at))

    rest = built.slice(records.num_rows)
    return _pre_aggregated(stage, records, rest, instance_of, late_fields)


def decoded_values(
    pipeline: Pipeline, values: pa.Array
) -> tuple[pa.Table, np.ndarray, dict[int, tuple[str, str]]]:
    """Kafka values decoded by the source's declared schema: the records' columns, the
    source row of each, and (reason, error) per source row that is a dead letter."""
    # Only called when columnar_values(pipeline) is not None: the source declares a schema.
    schema = cast(ValueSchema, pipeline.source.value_schema)
    return decode_values(schema, values, columns_read_by(pipeline).get(0))


def decode_values(
    schema: ValueSchema, values: pa.Array, keep: Collection[str] | None = None
) -> tuple[pa.Table, np.ndarray, dict[int, tuple[str, str]]]:
    """:func:`decoded_values` by ``schema`` (a source's among several); columns of the
    fields in ``keep`` only, when given (every field checked)."""
    dead: dict[int, tuple[str, str]] = {}
    present = values.is_valid().to_numpy(zero_copy_only=False)
    source_rows = np.nonzero(present)[0]
    for i in np.nonzero(~present)[0].tolist():
        dead[i] = ("undecodable", "record has no value (tombstone)")
    decoded = schema.decode(values if present.all() else values.filter(pa.array(present)), keep)
    for r, error in decoded.bad:
        dead[int(source_rows[r])] = (SCHEMA_MISMATCH, error)
    return decoded.table, source_rows[decoded.rows], dead


def add_dead_letters(
    out: EnvelopeBuilder, dead: dict[int, tuple[str, str]], batch: pa.RecordBatch,
    parallelism: int,
) -> None:  # fmt: skip
    """Dead-letter rows for the source rows in ``dead``, in source order."""
    topic, part, off, rkey, rvalue = (batch.column(c) for c in SOURCE_COLUMNS)
    for i in sorted(dead):
        reason, error = dead[i]
        out.dead(topic[i].as_py(), part[i].as_py(), off[i].as_py(), parallelism, reason,
                 error, rkey[i].as_py(), rvalue[i].as_py())  # fmt: skip


def column_steps(
    stage: StageOne, steps: Sequence[ColumnStep], table: pa.Table, rows: np.ndarray,
    batch: pa.RecordBatch,
) -> tuple[pa.Table, np.ndarray]:  # fmt: skip
    """Decoded records after column ``steps``, with their source rows; an Arrow error
    fails the batch, naming the pipeline, the step and the source partitions."""
    try:
        out, kept = run_columns(steps, table, rows)
    except ColumnStepFailed as e:
        partitions = sorted(
            consumed_per_partition(batch.column("topic"), batch.column("partition"))
        )
        where = ", ".join(f"{t}[{p}]" for t, p in partitions)
        raise ProcessError(
            f"pipeline {stage.pipeline.name!r} stage 1: {e} on {where}. Fix the expression "
            "(e.g. cast to a wider type before it can overflow); the batch is retried as is."
        ) from e
    return out, cast(np.ndarray, kept)


def _keyed_fields(pipeline: Pipeline, read: set[str]) -> tuple[str, ...]:
    """The declared fields of ``read``, the key and the event time, in declared order."""
    wanted = {*read, pipeline.key_by}
    if pipeline.event_time is not None:
        wanted.add(pipeline.event_time.field)
    return tuple(n for n in column_values(pipeline).names if n in wanted)


def _window_fields(pipeline: Pipeline) -> set[str]:
    """The fields a pre-aggregated window reads."""
    from microbatch.runtime.windowed import pre_aggregation

    operator = pre_aggregation(pipeline, enabled=True)
    return set() if operator is None else operator.fields_read()


def _pre_aggregated(
    stage: StageOne, records: pa.RecordBatch, rest: pa.RecordBatch, instance_of: np.ndarray,
    late_fields: Callable[[pa.Array], pa.Table],
) -> pa.RecordBatch:  # fmt: skip
    """The task's rows with its ``records`` reduced to window partials (``rest``: its dead
    letters and ``stat`` rows, counted on the records; ``late_fields``: every field of
    the records at some rows), in the exchange's schema."""
    from microbatch.runtime.windowed import exchange_schema, pre_aggregation, stage_one_partials

    pipeline = stage.pipeline
    operator = pre_aggregation(pipeline, enabled=True)
    if operator is None:  # StageOne.pre_aggregate is only set for such pipelines
        raise ValueError(f"pipeline {pipeline.name!r}: its windows cannot be pre-aggregated")
    schema = exchange_schema(pipeline, enabled=True)
    fields = value_columns(pa.Table.from_batches([records]), columnar_values(pipeline))
    partials = stage_one_partials(
        operator, records, fields, stage.watermark, instance_of, stage.parallelism, schema,
        pipeline.uid, late_fields,
    )  # fmt: skip
    n = rest.num_rows
    conformed = pa.RecordBatch.from_arrays(
        [rest.column(f.name) if f.name in rest.schema.names else pa.nulls(n, f.type)
         for f in schema],
        schema=schema,
    )  # fmt: skip
    return pa.concat_batches([partials, conformed])


def keys_of(stage: StageOne, column: pa.ChunkedArray) -> tuple[pa.Array, np.ndarray, np.ndarray]:
    """Key bytes and key-group of every row, computed once per distinct key (the task's
    :class:`KnownKeys` remembers them across batches), and which rows have no key (the
    slow path dead-letters them: a row with a key never needs its key computed again)."""
    encoded = column.combine_chunks().dictionary_encode()
    slow = encoded.indices.is_null().to_numpy(zero_copy_only=False).copy()
    index = encoded.indices.fill_null(0)
    distinct = encoded.dictionary
    if not len(distinct):  # every key null (or no row)
        return pa.nulls(len(index), pa.binary()), np.zeros(len(index), np.int64), slow
    known = stage._known_keys.get(str(distinct.type))
    if known is None and KnownKeys.takes(distinct.type):
        known = stage._known_keys[str(distinct.type)] = KnownKeys(stage.pipeline.max_parallelism)
    if known is not None:
        kbs, kgs = known.lookup(distinct)
    else:
        kbs, kgs = key_groups_of(distinct, stage.pipeline.max_parallelism)
    return kbs.take(index), kgs[index.to_numpy(zero_copy_only=False)], slow


class KnownKeys:
    """Key bytes and key-group of the distinct keys a task has seen, as Arrow arrays: a
    batch's distinct keys are looked up all at once (``index_in``), and only keys never
    seen go through Python. Kept for string and integer keys, whose Arrow equality is
    the key's equality (a float's is not: 0.0 and -0.0 are equal, their keys are not)."""

    LIMIT = 100_000  # distinct keys remembered; then the task starts over

    def __init__(self, max_parallelism: int) -> None:
        self.max_parallelism = max_parallelism
        self.keys: pa.Array | None = None
        self.key_bytes = pa.array([], pa.binary())
        self.key_groups = np.zeros(0, dtype=np.int64)

    @staticmethod
    def takes(key_type: pa.DataType) -> bool:
        return bool(pa.types.is_string(key_type) or pa.types.is_large_string(key_type)
                    or pa.types.is_integer(key_type))  # fmt: skip

    def lookup(self, distinct: pa.Array) -> tuple[pa.Array, np.ndarray]:
        """(key bytes, key-groups) of ``distinct`` (non-null, no repeats), in its order."""
        if self.keys is None or len(self.keys) + len(distinct) > self.LIMIT:
            self.keys = distinct.slice(0, 0)
            self.key_bytes, self.key_groups = pa.array([], pa.binary()), np.zeros(0, np.int64)
        at = pc.index_in(distinct, value_set=self.keys)
        new = at.is_null()
        positions = np.array(at.fill_null(-1).to_numpy(zero_copy_only=False), dtype=np.int64)
        if new.true_count:  # remembered after the known ones, in their order
            fresh = positions < 0
            positions[fresh] = len(self.keys) + np.arange(int(fresh.sum()))
            self._remember(distinct.filter(new))
        return self.key_bytes.take(pa.array(positions)), self.key_groups[positions]

    def _remember(self, keys: pa.Array) -> None:
        key_bytes, groups = self._encoded(keys)
        self.keys = pa.concat_arrays([cast(pa.Array, self.keys), keys])
        self.key_bytes = pa.concat_arrays([self.key_bytes, key_bytes])
        self.key_groups = np.concatenate([self.key_groups, groups])

    def _encoded(self, keys: pa.Array) -> tuple[pa.Array, np.ndarray]:
        return key_groups_of(keys, self.max_parallelism)


def event_times_of(
    stage: StageOne, table: pa.Table, slow: np.ndarray, late_before: int | None
) -> np.ndarray | None:
    """Each row's event time in epoch ms (None without event time); marks in ``slow``
    (in place) the rows the per-record path must judge: a null, an ISO-8601 string, a
    number out of int64's range (inf, nan), a record that may be late (behind ``late_before``;
    windows judge lateness per window)."""
    et = stage.pipeline.event_time
    if et is None:
        return None
    if et.field not in table.column_names:  # every record: missing_event_time
        slow |= True
        return np.zeros(table.num_rows, dtype=np.int64)
    column = table.column(et.field)
    if kind_of(table.schema.field(et.field)) not in _NUMERIC_TIME:
        slow |= True
        return np.zeros(table.num_rows, dtype=np.int64)
    slow |= column.is_null().to_numpy(zero_copy_only=False)
    if pa.types.is_floating(column.type):  # int64's range; inf and nan are not in it
        fits = pc.less(pc.abs(column.fill_null(0.0)), float(2**63))
        slow |= ~fits.to_numpy(zero_copy_only=False)
        column = pc.if_else(fits, column, 0.0)
    ts = pc.cast(column.fill_null(0), pa.int64(), safe=False).to_numpy()
    ts = np.array(ts, dtype=np.int64)  # writable
    if late_before is not None:
        slow |= ts < late_before
    return ts


def consumed_per_partition(topic: pa.Array, part: pa.Array) -> Counter[tuple[str, int]]:
    """Records consumed per source partition (a Kafka batch is mostly one partition's)."""
    if not len(part):
        return Counter()
    low, high = pc.min_max(part).values()
    first = topic[0]
    if low == high and first.is_valid and pc.all(pc.equal(topic, first)).as_py():
        return Counter({(first.as_py(), low.as_py()): len(part)})
    grouped = (
        pa.table({"t": topic, "p": part})
        .group_by(["t", "p"], use_threads=False)
        .aggregate([("p", "count")])
    )
    return Counter(
        dict(
            zip(
                zip(grouped.column("t").to_pylist(), grouped.column("p").to_pylist(), strict=True),
                grouped.column("p_count").to_pylist(),
                strict=True,
            )
        )
    )


def batch_records(pipeline: Any, recs: Any) -> Callable[[int, int], Any]:
    """How stage 2 gets the records ``[i, j)`` of an instance's records in processing
    order (``recs``: a ``sorted_records.SortedRecords``): :class:`LazyRecords` over the
    columns, or (payload pipelines) a :class:`DecodedRecords` list decoded now. Both give
    the records' columns (``columns()``) for windows."""
    values = columnar_values(pipeline)
    if values is not None and VALUE_PREFIX + values.names[0] not in recs.table.column_names:
        return lambda i, j: DecodedRecords()  # windows pre-aggregated: no record travels
    if values is not None:
        # One contiguous chunk per column, once: each key's records are a ``take``, which
        # on an instance's many-chunk table costs per chunk (~15x slower for small keys).
        fields = value_columns(recs.table, values).combine_chunks()
        built = RowDicts(fields, recs.rows)
        return lambda i, j: LazyRecords(fields, recs.rows.slice(i, j - i), built, i)
    from microbatch.runtime.decoding import payload_decoder
    from microbatch.runtime.envelope import decode_payload, decode_payloads

    decode = payload_decoder(pipeline)
    if decode is decode_payload:  # the envelope's own encoding: runs decode at once
        return PayloadRuns(recs.column("payload"), decode_payloads)
    payloads = recs.column("payload").to_pylist()
    return lambda i, j: DecodedRecords(map(decode, payloads[i:j]))


class PayloadRuns:
    """Records ``[i, j)`` of an instance's payloads, decoded a run of at least
    :attr:`RUN` at a time: keys come in order and most hold a few records, while one
    record decoded alone costs about as much as three in a run (a join of people by id:
    one record per key). ``payloads`` may be an Arrow binary column, made a list when
    first read (a join on columns never reads it)."""

    RUN = 1024

    def __init__(
        self,
        payloads: list[bytes] | pa.ChunkedArray | pa.Array,
        decode: Callable[[Sequence[bytes]], list[Any]],
    ) -> None:
        self._payloads = payloads
        self.decode = decode
        self.start = self.end = 0
        self.values: list[Any] = []

    @property
    def payloads(self) -> list[bytes]:
        if not isinstance(self._payloads, list):
            self._payloads = self._payloads.to_pylist()
        return self._payloads

    def __call__(self, i: int, j: int) -> DecodedRecords:
        if not self.start <= i <= j <= self.end:
            payloads = self.payloads
            self.start, self.end = i, max(j, min(i + self.RUN, len(payloads)))
            self.values = self.decode(payloads[self.start : self.end])
        return DecodedRecords(self.values[i - self.start : j - self.start])


class DecodedRecords(list[Any]):
    """Records decoded from payloads: a plain list, plus their columns for windows."""

    def columns(self, fields: Collection[str] | None = None) -> pa.Table:
        """Every field of any record is a column (null where a record lacks it); or only
        ``fields``, each a column even where no record has it (all null): a window reads
        a field or two, and building every field from the dicts costs about as much as
        the window itself."""
        from microbatch.sinks.base import table_of_dicts

        if fields is None or any(type(r) is not dict for r in self):
            return table_of_dicts(self)  # (what it raises for records that are not dicts)
        return pa.table({name: pa.array([r.get(name) for r in self]) for name in fields})

    def record(self, i: int) -> Any:
        return self[i]


class RowDicts:
    """An instance's records as dicts, built a run of keys at a time: building per key
    costs ~2.5x building the same rows in one go when keys have few records (a ``take``
    and a ``to_pylist`` per key), so a read of key ``k``'s rows may build the rows of the
    keys after it too. The run doubles while keys are read one after another (up to
    :attr:`MOST` rows) and starts over at the key's own rows after a skip, so a function
    that reads only a few keys' records builds little more than those."""

    MOST = 8192  # rows built at once, at most (besides one key's own rows)
    LEAST = 64

    __slots__ = ("_at", "_built", "_next", "_rows", "_run", "_table")

    def __init__(self, table: pa.Table, rows: pa.Array) -> None:
        self._table, self._rows = table, rows
        self._built: list[dict[str, Any]] = []
        self._at = 0  # first row of ``_built``
        self._next = -1  # where the last read ended: reading on from there grows the run
        self._run = self.LEAST

    def between(self, i: int, j: int) -> list[dict[str, Any]]:
        """Rows ``[i, j)`` (in the order of ``rows``) as dicts."""
        at, built = self._at, self._built
        if not (at <= i and j <= at + len(built)):
            self._run = min(self._run * 2, self.MOST) if i == self._next else self.LEAST
            stop = min(max(j, i + self._run), len(self._rows))
            at, built = i, self._table.take(self._rows.slice(i, stop - i)).to_pylist()
            self._at, self._built = at, built
        self._next = j
        return built[i - at : j - at]


class LazyRecords(Sequence[dict[str, Any]]):
    """Records as a read-only sequence of dicts, built from the columns (``table`` rows
    at ``rows``) on first access; ``len()`` builds nothing. ``shared``: the instance's
    :class:`RowDicts`, holding these records at ``[at, at + len(rows))``."""

    __slots__ = ("_at", "_built", "_rows", "_shared", "_table")

    def __init__(
        self, table: pa.Table, rows: pa.Array, shared: RowDicts | None = None, at: int = 0
    ) -> None:
        self._table, self._rows = table, rows
        self._shared, self._at = shared, at
        self._built: list[dict[str, Any]] | None = None

    def _records(self) -> list[dict[str, Any]]:
        if self._built is None:
            if self._shared is not None:
                self._built = self._shared.between(self._at, self._at + len(self._rows))
            else:
                self._built = self.columns().to_pylist()
        return self._built

    def __len__(self) -> int:
        return len(self._rows)

    def columns(self, fields: Collection[str] | None = None) -> pa.Table:
        """The records' columns (or those of ``fields`` the table has), without building
        a dict."""
        table = self._table
        if fields is not None:
            table = table.select([name for name in table.column_names if name in fields])
        return table.take(self._rows)

    def __getitem__(self, index: Any) -> Any:
        return self._records()[index]

    def record(self, i: int) -> dict[str, Any]:
        """The ``i``-th record alone (the others stay columns)."""
        if self._built is not None:
            return self._built[i]
        record: dict[str, Any] = self._table.take(self._rows.slice(i, 1)).to_pylist()[0]
        return record

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return iter(self._records())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Sequence) and not isinstance(other, str | bytes):
            return list(self) == list(other)
        return NotImplemented

    def __repr__(self) -> str:
        return f"LazyRecords({len(self)} records)"
