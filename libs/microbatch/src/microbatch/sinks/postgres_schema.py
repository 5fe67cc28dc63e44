"""The PostgreSQL sink's table, from its declared Arrow schema: types, creation, checks.

Each Arrow type has one PostgreSQL type (:func:`pg_type`), spelled as ``format_type``
spells it, so a table's columns compare by text. A table created by the sink has the
schema's columns, the batch column :data:`BATCH_COLUMN` and, in upsert mode, a primary
key on the key columns. An existing table is checked column by column
(:func:`plan_columns`): a nullable column the sink adds is added to the table; a type
change, a NOT NULL column the sink drops, or a missing unique index on the key is a
:class:`ConfigError` naming the column.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Mapping, Sequence

import pyarrow as pa

from microbatch.errors import ConfigError

#: The batch that last wrote the row: what a backfill replaces (append mode) and what a
#: reader may filter on. Every table the sink writes has it.
BATCH_COLUMN = "_microbatch_batch"
#: Where a staged row came from within its batch (instance, then emission order): the
#: upsert's "last wins" order. Only in the session's temporary staging table.
ORDER_COLUMN = "_microbatch_seq"
RESERVED = (BATCH_COLUMN, ORDER_COLUMN)

_SIMPLE: tuple[tuple[object, str], ...] = (
    (pa.types.is_boolean, "boolean"),
    (pa.types.is_int8, "smallint"),
    (pa.types.is_int16, "smallint"),
    (pa.types.is_uint8, "smallint"),
    (pa.types.is_int32, "integer"),
    (pa.types.is_uint16, "integer"),
    (pa.types.is_int64, "bigint"),
    (pa.types.is_uint32, "bigint"),
    (pa.types.is_uint64, "numeric(20,0)"),
    (pa.types.is_float16, "real"),
    (pa.types.is_float32, "real"),
    (pa.types.is_float64, "double precision"),
    (pa.types.is_string, "text"),
    (pa.types.is_large_string, "text"),
    (pa.types.is_binary, "bytea"),
    (pa.types.is_large_binary, "bytea"),
    (pa.types.is_date, "date"),
)


def pg_type(sink: str, field: pa.Field) -> str:
    """The column type of ``field`` as PostgreSQL's ``format_type`` prints it."""
    t = field.type
    for is_type, name in _SIMPLE:
        if is_type(t):  # type: ignore[operator]
            return name
    if pa.types.is_timestamp(t):
        return "timestamp with time zone" if t.tz else "timestamp without time zone"
    if pa.types.is_decimal(t):
        return f"numeric({t.precision},{t.scale})"
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        item = t.value_type
        if not (pa.types.is_list(item) or pa.types.is_large_list(item) or pa.types.is_binary(item)):
            with contextlib.suppress(ConfigError):
                return pg_type(sink, pa.field(field.name, item)) + "[]"
    raise ConfigError(
        f"sink {sink!r}: column {field.name!r} has type {t}, which the PostgreSQL sink does "
        "not write; use integers, floats, boolean, string, binary, date, timestamp, "
        "decimal or a list of one of them but binary (a struct or map can travel as a "
        "JSON string)"
    )


@dataclasses.dataclass(frozen=True)
class TableName:
    """``schema.table`` (``public`` when the name has no schema)."""

    schema: str
    table: str

    @classmethod
    def parse(cls, sink: str, name: str) -> TableName:
        parts = name.split(".")
        if not 1 <= len(parts) <= 2 or not all(parts):
            raise ConfigError(f"sink {sink!r}: table {name!r} is not 'table' or 'schema.table'")
        return cls("public", parts[0]) if len(parts) == 1 else cls(parts[0], parts[1])

    def __str__(self) -> str:
        return f"{self.schema}.{self.table}"


@dataclasses.dataclass(frozen=True)
class Column:
    """A column of an existing table, as the catalog describes it."""

    name: str
    type: str
    not_null: bool


def check_declared(sink: str, schema: pa.Schema, key: Sequence[str], mode: str) -> None:
    """Refuse, when the sink is built, a schema or key the table could not hold."""
    for field in schema:
        pg_type(sink, field)
        if field.name in RESERVED:
            raise ConfigError(
                f"sink {sink!r}: column {field.name!r} is the sink's own; rename yours"
            )
    missing = [k for k in key if k not in schema.names]
    if missing:
        raise ConfigError(
            f"sink {sink!r}: key column(s) {missing} are not in the schema "
            f"({', '.join(schema.names)})"
        )
    if mode == "upsert" and not key:
        raise ConfigError(
            f"sink {sink!r}: mode='upsert' needs key=(...), the columns that identify a "
            "row (the table's primary key); or use mode='append'"
        )


def create_statement(table: TableName, schema: pa.Schema, key: Sequence[str], mode: str) -> str:
    """``CREATE TABLE IF NOT EXISTS`` for the sink's table (identifiers quoted)."""
    cols = [
        f"{quote(f.name)} {pg_type('', f)}{'' if f.nullable and f.name not in key else ' NOT NULL'}"
        for f in schema
    ]
    cols.append(f"{quote(BATCH_COLUMN)} bigint NOT NULL")
    if mode == "upsert":
        cols.append(f"PRIMARY KEY ({', '.join(quote(k) for k in key)})")
    return f"CREATE TABLE IF NOT EXISTS {qualified(table)} ({', '.join(cols)})"


def plan_columns(
    where: str,
    columns: Mapping[str, Column],
    schema: pa.Schema,
    key: Sequence[str],
    unique_keys: Sequence[frozenset[str]],
    mode: str,
) -> list[pa.Field]:
    """The nullable columns to add to an existing table, or a :class:`ConfigError`
    naming the column that does not fit (``where`` names pipeline, sink and table)."""
    if BATCH_COLUMN not in columns:
        raise ConfigError(
            f"{where}: the table exists but has no {BATCH_COLUMN!r} column, so it was not "
            f"created by this sink; add it (ALTER TABLE ... ADD COLUMN {BATCH_COLUMN} bigint "
            "NOT NULL DEFAULT -1) or point the sink to a new table"
        )
    add = []
    for field in schema:
        want = pg_type("", field)
        have = columns.get(field.name)
        if have is None:
            if not field.nullable:
                raise ConfigError(
                    f"{where}: new column {field.name!r} is NOT NULL, but the table's rows "
                    "have no value for it; declare it nullable to add it"
                )
            add.append(field)
        elif have.type != want:
            raise ConfigError(
                f"{where}: column {field.name!r} is {have.type} in the table but {want} in "
                "the sink's schema; keep the table's type in the schema, or ALTER the column"
            )
    for name, col in columns.items():
        if name not in schema.names and name != BATCH_COLUMN and col.not_null:
            raise ConfigError(
                f"{where}: column {name!r} is NOT NULL in the table but missing from the "
                "sink's schema; add it to the schema or give it a DEFAULT"
            )
    if mode == "upsert" and frozenset(key) not in unique_keys:
        raise ConfigError(
            f"{where}: upsert needs a primary key or unique index on exactly "
            f"({', '.join(key)}); the table has "
            f"{[sorted(u) for u in unique_keys] or 'none'}. Add one "
            f"(ALTER TABLE ... ADD PRIMARY KEY ({', '.join(key)}))"
        )
    return add


def quote(identifier: str) -> str:
    """A double-quoted SQL identifier."""
    return '"' + identifier.replace('"', '""') + '"'


def qualified(table: TableName) -> str:
    return f"{quote(table.schema)}.{quote(table.table)}"
