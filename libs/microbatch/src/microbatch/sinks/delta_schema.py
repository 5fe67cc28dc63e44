"""The Delta sink's schema rules: what a sink's Arrow schema asks of an existing table —
nullable columns to add, or an error naming the column that cannot change in place."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from typing import Any

import pyarrow as pa

from microbatch.errors import SinkError


@dataclasses.dataclass(frozen=True)
class SchemaChange:
    """What the sink's schema asks of the table's: columns to add (nullable)."""

    add: tuple[pa.Field, ...] = ()


def delta_fields(schema: pa.Schema) -> list[dict[str, Any]]:
    """The Delta schema's fields (name, type, nullable) of an Arrow schema."""
    from deltalake import Schema

    return json.loads(Schema.from_arrow(schema).to_json())["fields"]


def plan_schema(
    where: str,
    table_fields: Sequence[Mapping[str, Any]],
    table_partitions: Sequence[str],
    sink_schema: pa.Schema,
    partition_by: Sequence[str],
) -> SchemaChange:
    """Compare the table's Delta fields with the sink's schema: the nullable columns to add,
    or a :class:`SinkError` (``where`` names pipeline and sink) naming the column."""
    mine = {f["name"]: f for f in delta_fields(sink_schema)}
    theirs = {f["name"]: f for f in table_fields}
    if list(table_partitions) != list(partition_by):
        raise SinkError(
            f"{where}: the table is partitioned by {list(table_partitions)} but the sink says "
            f"partition_by={list(partition_by)}; make them equal (a table's partitioning "
            "cannot change in place)"
        )
    for name, field in theirs.items():
        if name not in mine:
            if not field["nullable"]:
                raise SinkError(
                    f"{where}: column {name!r} is NOT NULL in the table but missing from the "
                    "sink's schema; add it back to the schema (or make the column nullable "
                    "in the table first)"
                )
            continue
        new = mine[name]
        if new["type"] != field["type"]:
            raise SinkError(
                f"{where}: column {name!r} has type {json.dumps(field['type'])} in the table "
                f"but {json.dumps(new['type'])} in the sink's schema; Delta cannot change a "
                "column's type in place: keep the old type, or write a new column or table"
            )
        if not field["nullable"] and new["nullable"]:
            raise SinkError(
                f"{where}: column {name!r} is NOT NULL in the table but nullable in the "
                "sink's schema; declare it pa.field(..., nullable=False)"
            )
    added = []
    for name in mine:
        if name in theirs:
            continue
        field = sink_schema.field(name)
        if not field.nullable:
            raise SinkError(
                f"{where}: new column {name!r} is NOT NULL, but the table's existing rows "
                "have no value for it; declare it nullable to add it"
            )
        added.append(field)
    return SchemaChange(tuple(added))
