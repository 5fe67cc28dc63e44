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
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from microbatch.keygroups import encode_key, key_group_of_bytes
from microbatch.runtime.envelope import (
    RECORD,
    SOURCE_COLUMNS,
    VALUE_PREFIX,
    EnvelopeBuilder,
    envelope_schema,
    value_columns,
)
from microbatch.runtime.pipeline import columnar_values
from microbatch.runtime.schema import SCHEMA_MISMATCH, ValueSchema, kind_of

if TYPE_CHECKING:
    from microbatch.runtime.stage_one import StageOne

_NUMERIC_TIME = ("long", "int", "double")


def columnar_envelopes(stage: StageOne, batch: pa.RecordBatch) -> pa.RecordBatch:
    """Kafka rows (:data:`SOURCE_COLUMNS`) → envelope rows with the decoded columns."""
    from microbatch.runtime.stage_one import _Bad  # the per-record path's verdicts

    pipeline = stage.pipeline
    # Only called when columnar_values(pipeline) is not None: the source declares a schema.
    schema = cast(ValueSchema, pipeline.source.value_schema)
    values = schema.arrow_schema
    out = EnvelopeBuilder(envelope_schema(values))
    topic, part, off, rkey, rvalue = (batch.column(c) for c in SOURCE_COLUMNS)
    dead: dict[int, tuple[str, str]] = {}

    present = rvalue.is_valid().to_numpy(zero_copy_only=False)
    source_rows = np.nonzero(present)[0]
    for i in np.nonzero(~present)[0].tolist():
        dead[i] = ("undecodable", "record has no value (tombstone)")
    decoded = schema.decode(rvalue if present.all() else rvalue.filter(pa.array(present)))
    for r, error in decoded.bad:
        dead[int(source_rows[r])] = (SCHEMA_MISMATCH, error)
    rows = source_rows[decoded.rows]  # source row of each decoded record
    table = decoded.table

    key_bytes, key_groups, slow = _keys(stage, table.column(pipeline.key_by))
    ts = _event_times(stage, table, slow)
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
        pa.array(np.full(n, RECORD, dtype=object), pa.string()),
        topic.take(take),
        part.take(take),
        off.take(take),
        pa.array(np.zeros(n, dtype=np.int32)),
        pa.array(instance_of[kgs]),
        pa.array(kgs),
        key_bytes.take(pa.array(keep)),
        pa.nulls(n, pa.int64()) if ts is None else pa.array(ts[keep], pa.int64()),
        pa.nulls(n, pa.binary()),
        *(table.column(f.name).take(pa.array(keep)).combine_chunks() for f in values),
    ]
    records = pa.RecordBatch.from_arrays(columns, schema=out.schema)
    for i in sorted(dead):
        reason, error = dead[i]
        out.dead(topic[i].as_py(), part[i].as_py(), off[i].as_py(), stage.parallelism, reason,
                 error, rkey[i].as_py(), rvalue[i].as_py())  # fmt: skip
    built = out.build(_inputs(topic, part), stage.parallelism, records)  # stats: of records
    if not stage.pre_aggregate:
        return built
    return _pre_aggregated(stage, records, built.slice(records.num_rows), instance_of)


def _pre_aggregated(
    stage: StageOne, records: pa.RecordBatch, rest: pa.RecordBatch, instance_of: np.ndarray
) -> pa.RecordBatch:
    """The task's rows with its ``records`` reduced to window partials (``rest``: its dead
    letters and ``stat`` rows, counted on the records), in the exchange's schema."""
    from microbatch.runtime.windowed import exchange_schema, pre_aggregation, stage_one_partials

    pipeline = stage.pipeline
    operator = pre_aggregation(pipeline, enabled=True)
    if operator is None:  # StageOne.pre_aggregate is only set for such pipelines
        raise ValueError(f"pipeline {pipeline.name!r}: its windows cannot be pre-aggregated")
    schema = exchange_schema(pipeline, enabled=True)
    fields = value_columns(pa.Table.from_batches([records]), columnar_values(pipeline))
    partials = stage_one_partials(
        operator, records, fields, stage.watermark, instance_of, stage.parallelism, schema,
        pipeline.uid,
    )  # fmt: skip
    n = rest.num_rows
    conformed = pa.RecordBatch.from_arrays(
        [rest.column(f.name) if f.name in rest.schema.names else pa.nulls(n, f.type)
         for f in schema],
        schema=schema,
    )  # fmt: skip
    return pa.concat_batches([partials, conformed])


def _keys(stage: StageOne, column: pa.ChunkedArray) -> tuple[pa.Array, np.ndarray, np.ndarray]:
    """Key bytes and key-group of every row, computed once per distinct key (the task's
    cache of string keys helps across batches), and which rows have no key (the slow
    path dead-letters them: a row with a key never needs its key computed again)."""
    encoded = column.combine_chunks().dictionary_encode()
    cache = stage._str_keys
    kbs, kgs = [], []
    for key in encoded.dictionary.to_pylist():
        known = cache.get(key) if type(key) is str else None
        if known is None:
            kb = encode_key(key)
            known = (kb, key_group_of_bytes(kb, stage.pipeline.max_parallelism))
            if type(key) is str:
                if len(cache) >= 100_000:
                    cache.clear()
                cache[key] = known
        kbs.append(known[0])
        kgs.append(known[1])
    slow = encoded.indices.is_null().to_numpy(zero_copy_only=False).copy()
    index = encoded.indices.fill_null(0)
    if not kbs:  # every key null (or no row)
        return pa.nulls(len(index), pa.binary()), np.zeros(len(index), np.int64), slow
    key_bytes = pa.array(kbs, pa.binary()).take(index)
    return key_bytes, np.array(kgs, dtype=np.int64)[index.to_numpy(zero_copy_only=False)], slow


def _event_times(stage: StageOne, table: pa.Table, slow: np.ndarray) -> np.ndarray | None:
    """Each row's event time in epoch ms (None without event time); marks in ``slow``
    (in place) the rows the per-record path must judge: a null, an ISO-8601 string, a
    record that may be late (behind the watermark; windows judge lateness per window)."""
    et = stage.pipeline.event_time
    if et is None:
        return None
    column = table.column(et.field)
    if kind_of(table.schema.field(et.field)) not in _NUMERIC_TIME:
        slow |= True
        return np.zeros(table.num_rows, dtype=np.int64)
    slow |= column.is_null().to_numpy(zero_copy_only=False)
    ts = pc.cast(column.fill_null(0), pa.int64(), safe=False).to_numpy()
    ts = np.array(ts, dtype=np.int64)  # writable
    late_before = stage._late_before
    if late_before is not None:
        slow |= ts < late_before
    return ts


def _inputs(topic: pa.Array, part: pa.Array) -> Counter[tuple[str, int]]:
    """Records consumed per source partition."""
    grouped = pa.table({"t": topic, "p": part}).group_by(["t", "p"]).aggregate([("p", "count")])
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
    order (``recs``: a ``stage_two.SortedRecords``): :class:`LazyRecords` over the
    columns, or (payload pipelines) a :class:`DecodedRecords` list decoded now. Both give
    the records' columns (``columns()``) for windows."""
    values = columnar_values(pipeline)
    if values is not None and VALUE_PREFIX + values.names[0] not in recs.table.column_names:
        return lambda i, j: DecodedRecords()  # windows pre-aggregated: no record travels
    if values is not None:
        # One contiguous chunk per column, once: each key's records are a ``take``, which
        # on an instance's many-chunk table costs per chunk (~15x slower for small keys).
        fields = value_columns(recs.table, values).combine_chunks()
        return lambda i, j: LazyRecords(fields, recs.rows.slice(i, j - i))
    from microbatch.runtime.stage_one import payload_decoder

    decode = payload_decoder(pipeline)
    payloads = recs.column("payload").to_pylist()
    return lambda i, j: DecodedRecords(decode(p) for p in payloads[i:j])


class DecodedRecords(list[Any]):
    """Records decoded from payloads: a plain list, plus their columns for windows."""

    def columns(self) -> pa.Table:
        """Every field of any record is a column (null where a record lacks it)."""
        from microbatch.sinks.base import table_of_dicts

        return table_of_dicts(self)

    def record(self, i: int) -> Any:
        return self[i]


class LazyRecords(Sequence[dict[str, Any]]):
    """Records as a read-only sequence of dicts, built from the columns (``table`` rows
    at ``rows``) on first access; ``len()`` builds nothing."""

    __slots__ = ("_built", "_rows", "_table")

    def __init__(self, table: pa.Table, rows: pa.Array) -> None:
        self._table, self._rows = table, rows
        self._built: list[dict[str, Any]] | None = None

    def _records(self) -> list[dict[str, Any]]:
        if self._built is None:
            self._built = self.columns().to_pylist()
        return self._built

    def __len__(self) -> int:
        return len(self._rows)

    def columns(self) -> pa.Table:
        """The records' columns, without building a dict."""
        return self._table.take(self._rows)

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
