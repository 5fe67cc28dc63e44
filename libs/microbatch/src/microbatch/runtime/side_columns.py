"""A join's records of one batch as Arrow columns, per input side.

Records reach a keyed step as payloads (the codec's bytes of each record). Where a side's
records are all alike — rows of a source's declared columns (its ``value_schema`` after
its ``where``/``select``, with no record-wise step between: :func:`input_schemas`), or
flat records of the same fields and types, as a window's output rows are — their payloads
can be read straight back into columns
(:func:`~microbatch.state.codec_rows.decode_rows`), and a function that reads columns
(a ``TableJoin`` or ``WindowJoin`` with ``select=fields(...)``) joins them without a dict
per record. The schema is checked on every record of every batch: one payload that is
not exactly such a row and the side has no table (None), so the function takes its
records as before.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, overload

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from microbatch.runtime.column_plan import decoded_as_columns
from microbatch.runtime.columns import output_schema
from microbatch.runtime.graph import edges_into
from microbatch.state.codec import encode_value
from microbatch.state.codec_rows import decode_rows, schema_of_records

if TYPE_CHECKING:
    from microbatch.runtime.pipeline import Pipeline
    from microbatch.runtime.sorted_records import SortedRecords

#: A ``None`` record's payload: a tombstone's.
_DELETE = encode_value(None)


class SideColumns:
    """One instance's records of a batch, in processing order, as payloads tagged by
    side; :meth:`table` reads a side's as the columns of its schema. On the ``deletes``
    sides (a table join's table: the function's ``tombstone_sides``) a ``None`` record
    is a delete, a row of nulls in the table (:meth:`deleted` says which)."""

    def __init__(
        self, payloads: pa.Array, sides: np.ndarray, schemas: Mapping[int, pa.Schema],
        deletes: Collection[int] = (),
    ) -> None:  # fmt: skip
        self._payloads, self._sides, self._schemas = payloads, sides, schemas
        self._deletes = deletes
        self._tables: dict[int, pa.Table | None] = {}
        self._of_side: dict[int, pa.Array] = {}

    def count(self, side: int) -> int:
        """How many records side ``side`` has."""
        return int((self._sides == side).sum())

    def payloads(self, side: int) -> pa.Array:
        """Side ``side``'s payloads, in processing order (row ``i`` of :meth:`table`)."""
        if side not in self._of_side:
            self._of_side[side] = self._payloads.filter(pa.array(self._sides == side))
        return self._of_side[side]

    def deleted(self, side: int) -> np.ndarray:
        """Per record of side ``side``: is it a delete (a ``None`` record on a side that
        takes them)?"""
        payloads = self.payloads(side)
        if side not in self._deletes:
            return np.zeros(len(payloads), dtype=bool)
        deletes = pc.equal(payloads, pa.scalar(_DELETE, pa.binary()))
        return np.asarray(deletes.to_numpy(zero_copy_only=False), dtype=bool)

    def table(self, side: int) -> pa.Table | None:
        """Side ``side``'s records as columns, in processing order (a delete: a row of
        nulls); None when a record is not a row of the side's schema — its declared one,
        else the one its first records suggest
        (:func:`~microbatch.state.codec_rows.schema_of_records`: a window's output rows,
        records of a source without a declared schema) — or every one is a delete and
        no schema is declared."""
        if side not in self._tables:
            payloads, deleted = self.payloads(side), self.deleted(side)
            rows = payloads.filter(pa.array(~deleted)) if deleted.any() else payloads
            schema = self._schemas.get(side) or schema_of_records(rows)
            table = None if schema is None else decode_rows(rows, schema)
            if table is not None and deleted.any():  # the deletes back in place, as nulls
                table = table.take(pa.array(np.cumsum(~deleted) - 1, mask=deleted))
            self._tables[side] = table
        return self._tables[side]


def input_schemas(pipeline: Pipeline, target: str) -> dict[int, pa.Schema]:
    """Per input side of step ``target``: the schema its records are rows of, where they
    come straight from a source decoded as columns (no enrichment, no record-wise step
    before the step, not from another keyed step)."""
    if pipeline.enrich is not None:
        return {}
    decoded = decoded_as_columns(pipeline)
    out: dict[int, pa.Schema] = {}
    for edge in edges_into(pipeline, target):
        origin = edge.origin
        if not isinstance(origin, int) or edge.chain or origin not in decoded:
            continue
        if pipeline.inputs:
            source, prefix = pipeline.inputs[origin].source, pipeline.inputs[origin].prefix
        else:
            source, prefix = pipeline.source, tuple(pipeline.prefix)
        if prefix or source.value_schema is None:
            continue
        where = f"pipeline {pipeline.name!r}, step {target!r}"
        out[edge.side] = output_schema(decoded[origin], source.value_schema.arrow_schema, where)
    return out


def side_columns(
    pipeline: Pipeline, step: str | None, fn: Any, recs: SortedRecords, sides: np.ndarray | None
) -> SideColumns | None:
    """The records of step ``step`` (None: the first) as columns per side, for a function
    that reads them (``fn.reads_columns``); else None."""
    from microbatch.runtime.decoding import payload_decoder
    from microbatch.runtime.envelope import decode_payload
    from microbatch.runtime.graph import first_uid

    if sides is None or not getattr(fn, "reads_columns", False):
        return None
    if step is None and payload_decoder(pipeline) is not decode_payload:
        return None  # the first step's payloads are raw source values, not records
    schemas = input_schemas(pipeline, step if step is not None else first_uid(pipeline))
    payloads = recs.column("payload").combine_chunks()
    return SideColumns(payloads, sides, schemas, getattr(fn, "tombstone_sides", ()))


class RecordsOnUse(Sequence[Any]):
    """The records ``records_of(0, count)``, decoded when first read: a function that
    takes a batch as columns never reads them."""

    def __init__(self, records_of: Callable[[int, int], Sequence[Any]], count: int) -> None:
        self._records_of, self._count = records_of, count
        self._records: Sequence[Any] | None = None

    def _all(self) -> Sequence[Any]:
        if self._records is None:
            self._records = self._records_of(0, self._count)
        return self._records

    def __len__(self) -> int:
        return self._count

    @overload
    def __getitem__(self, i: int) -> Any: ...
    @overload
    def __getitem__(self, i: slice) -> Sequence[Any]: ...
    def __getitem__(self, i: int | slice) -> Any:
        return self._all()[i]

    def __iter__(self) -> Iterator[Any]:
        return iter(self._all())
