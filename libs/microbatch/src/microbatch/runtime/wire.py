"""Envelope rows on the wire: ``kind`` and ``topic`` as small integer codes.

Every row through an exchange carried two strings Python never needed there: its kind
(``"record"``) and its topic or marker (``"payments"``, ``"@cards>merchants"``). Spark
converts and shuffles each string per row; measured on 3M rows through one exchange,
the codes cost ~14% less CPU. Python builds and reads envelopes with the strings as
before; only the rows crossing Spark carry codes: :meth:`Tags.to_wire` where a
``mapInArrow`` body yields, :meth:`Tags.from_wire` where one receives (a no-op on rows
that never left Python).

A code indexes the pipeline's :class:`Tags`: the kinds (fixed) and every string a row's
``topic`` can hold — its sources' topics, the markers of its edges, its keyed steps'
uids (``result`` rows) — derived from the pipeline alone, so the driver and every task
agree. A string outside them is a bug, and fails the task naming it rather than
shuffling a row that could not be read back.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

import pyarrow as pa
import pyarrow.compute as pc

from microbatch.errors import BatchError
from microbatch.runtime.envelope import (
    DEAD_LETTER,
    OUTPUT,
    PACKED,
    PARTIAL,
    PENDING,
    RECORD,
    RESULT,
    STAT,
    TICK,
)
from microbatch.runtime.graph import edges_of, marker, source_topics, step_order

if TYPE_CHECKING:
    from microbatch.runtime.pipeline import Pipeline

#: Every kind of envelope row; a kind's code is its place here (never reorder: rows of
#: a running batch are read by the same code only, but keep the order stable anyway).
KINDS = (RECORD, DEAD_LETTER, PARTIAL, PENDING, STAT, TICK, RESULT, OUTPUT, PACKED)
KIND_CODE, TOPIC_CODE = pa.int8(), pa.int16()

Rows = TypeVar("Rows", pa.Table, pa.RecordBatch)


class Tags:
    """The strings a pipeline's envelope rows carry in ``kind`` and ``topic``."""

    def __init__(self, pipeline: Pipeline) -> None:
        self.name = pipeline.name
        # Result rows: the step's uid, "" for the first step's.
        topics: set[str] = {"", *step_order(pipeline)}
        count = len(pipeline.inputs) or 1
        for index in range(count):
            topics.update(source_topics(pipeline, index))
        for edge in edges_of(pipeline):
            if isinstance(edge.origin, int):
                topics.update(
                    marker(edge.origin, edge.target, t)
                    for t in source_topics(pipeline, edge.origin)
                )
            else:
                topics.add(marker(edge.origin, edge.target))
        if len(topics) > 32_767:
            raise BatchError(f"pipeline {pipeline.name!r}: {len(topics)} topics and markers")
        self.topics = pa.array(sorted(topics), pa.string())
        self.kinds = pa.array(KINDS, pa.string())

    def wire_schema(self, schema: pa.Schema) -> pa.Schema:
        """``schema`` (an exchange's) with ``kind`` and ``topic`` as codes."""
        at = schema.get_field_index
        schema = schema.set(at("kind"), pa.field("kind", KIND_CODE))
        return schema.set(at("topic"), pa.field("topic", TOPIC_CODE))

    def to_wire(self, rows: Rows) -> Rows:
        """``rows`` with ``kind`` and ``topic`` replaced by their codes."""
        rows = self._coded(rows, "kind", self.kinds, KIND_CODE)
        return self._coded(rows, "topic", self.topics, TOPIC_CODE)

    def from_wire(self, rows: Rows) -> Rows:
        """``rows`` with ``kind`` and ``topic`` as strings again (as they are: if they
        never left Python)."""
        for name, values in (("kind", self.kinds), ("topic", self.topics)):
            at = rows.schema.get_field_index(name)
            column = rows.column(at)
            if pa.types.is_integer(column.type):
                rows = rows.set_column(at, name, values.take(column))
        return rows

    def kind_code(self, kind: str) -> pa.Scalar:
        """The code of ``kind``, to compare a wire ``kind`` column with."""
        return pa.scalar(KINDS.index(kind), KIND_CODE)

    def topic_codes(self, keep: Callable[[str], bool]) -> pa.Array:
        """The codes of the topics and markers ``keep`` accepts."""
        return pa.array(
            [i for i, topic in enumerate(self.topics.to_pylist()) if keep(topic)], TOPIC_CODE
        )

    def topic_of(self, code: int | str) -> str:
        """A ``topic`` value read on the driver from collected rows."""
        return code if isinstance(code, str) else str(self.topics[code].as_py())

    def _coded(self, rows: Rows, name: str, values: pa.Array, code: pa.DataType) -> Rows:
        at = rows.schema.get_field_index(name)
        column = rows.column(at)
        if not pa.types.is_string(column.type):
            return rows
        codes = pc.index_in(column, value_set=values)
        if codes.null_count != column.null_count:
            known = set(values.to_pylist())
            odd = sorted({v for v in column.to_pylist() if v is not None and v not in known})
            raise BatchError(
                f"pipeline {self.name!r}: envelope {name} {odd[:3]} is none of the pipeline's "
                f"({len(known)} known); a row of it could not be read back after the exchange"
            )
        return rows.set_column(at, pa.field(name, code), codes.cast(code))


def tags_of(pipeline: Pipeline) -> Tags:
    """The pipeline's :class:`Tags`, made once per pipeline object."""
    tags = pipeline.__dict__.get("_wire_tags")
    if tags is None:
        tags = Tags(pipeline)
        object.__setattr__(pipeline, "_wire_tags", tags)
    return tags
