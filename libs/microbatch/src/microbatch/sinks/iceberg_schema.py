"""The Iceberg sink's schema against its table's: which nullable columns to add, or a
:class:`SinkError` naming the column (docs/iceberg.md, "Schema").

Checked in stage 2 (before the checkpoint commits) and again before each commit. Types
compare as Arrow sees them, so field ids do not matter; no type is promoted in place.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pyarrow as pa

from microbatch.errors import SinkError

__all__ = ["arrow_type", "check_schema", "iceberg_schema"]


def iceberg_schema(schema: pa.Schema, where: str) -> Any:
    """An Arrow schema as an Iceberg schema (fresh field ids)."""
    from pyiceberg.catalog import Catalog
    from pyiceberg.schema import assign_fresh_schema_ids

    try:  # the conversion pyiceberg's create_table applies to a pyarrow schema
        return assign_fresh_schema_ids(Catalog._convert_schema_if_needed(schema))
    except Exception as e:
        raise SinkError(
            f"{where}: the schema has no Iceberg equivalent ({e}); use types Iceberg "
            "has (string, int32/int64, float32/64, boolean, date, timestamp[us], decimal, "
            "binary, lists, structs, maps)"
        ) from e


def check_schema(
    schema: pa.Schema, partition_by: Sequence[str], table: Any, where: str
) -> list[pa.Field]:
    """The nullable columns of ``schema`` (the sink's) that ``table`` lacks, to be added;
    a :class:`SinkError` naming the column for any other difference."""
    mine = iceberg_schema(schema, where)
    theirs = table.schema()
    spec_columns = [theirs.find_field(f.source_id).name for f in table.spec().fields]
    if spec_columns != list(partition_by):
        raise SinkError(
            f"{where}: the table is partitioned by {spec_columns} but the sink says "
            f"partition_by={list(partition_by)}; make them equal (or evolve the "
            "table's partition spec first)"
        )
    names = {f.name for f in mine.fields}
    for field in theirs.fields:
        if field.name not in names:
            if field.required:
                raise SinkError(
                    f"{where}: column {field.name!r} is required in the table but "
                    "missing from the sink's schema; add it back to the schema (or make "
                    "the column optional in the table first)"
                )
            continue
        new = mine.find_field(field.name)
        if arrow_type(new.field_type) != arrow_type(field.field_type):
            raise SinkError(
                f"{where}: column {field.name!r} has type {field.field_type} in the "
                f"table but {new.field_type} in the sink's schema; keep the table's type, or "
                "write a new column or table"
            )
        if field.required and not new.required:
            raise SinkError(
                f"{where}: column {field.name!r} is required in the table but nullable "
                "in the sink's schema; declare it pa.field(..., nullable=False)"
            )
    known = {f.name for f in theirs.fields}
    added = []
    for field in mine.fields:
        if field.name in known:
            continue
        if field.required:
            raise SinkError(
                f"{where}: new column {field.name!r} is NOT NULL, but the table's "
                "existing rows have no value for it; declare it nullable to add it"
            )
        added.append(schema.field(field.name))
    return added


def arrow_type(iceberg_type: Any) -> pa.DataType:
    """An Iceberg type as Arrow sees it, so types compare without their field ids."""
    from pyiceberg.io.pyarrow import schema_to_pyarrow

    return schema_to_pyarrow(iceberg_type, include_field_ids=False)
