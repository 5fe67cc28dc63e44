"""Rows the PostgreSQL table refuses — a CHECK or NOT NULL constraint, a value out of
range, a byte sequence the encoding rejects — found only once a batch's bulk write has
failed, so a batch without them pays nothing.

The search (:func:`find_refused`) writes the batch again piece by piece, each piece in a
savepoint, halving a piece that fails until each refused row stands alone: the other rows
are written, the refused ones come back with PostgreSQL's error. About ``2·log2(n)``
statements per refused row (a batch where most rows are refused costs ~2 statements per
row). Only a data exception (SQLSTATE class 22) or an integrity violation (class 23) is a
refusal; anything else (a lost connection, a timeout) fails the batch as before.

With ``on_refused="dead_letter"`` the refused rows go to a table next to the sink's
(:func:`refused_table_statements`), inserted in the batch's own transaction: they are
published exactly when the accepted rows and the batch's commit row are.
"""

from __future__ import annotations

import base64
import dataclasses
import datetime as dt
import decimal
import json
from collections.abc import Callable, Sequence
from typing import Any

import pyarrow as pa

from microbatch.sinks.postgres_schema import BATCH_COLUMN, TableName, qualified, quote

#: What a refused row does: fail the batch naming it, or go to the refused table.
REFUSAL_MODES = ("fail", "dead_letter")
#: SQLSTATE classes of a row the table refuses: 22 data exception, 23 integrity violation.
REFUSED_CLASSES = ("22", "23")
#: The refused table's name when the sink does not give one: ``<table>_refused``.
REFUSED_SUFFIX = "_refused"


@dataclasses.dataclass(frozen=True)
class Refusal:
    """One refused row: where it is in the batch's written rows, and PostgreSQL's error."""

    index: int
    sqlstate: str
    constraint: str | None
    column: str | None
    message: str
    detail: str | None

    @classmethod
    def from_error(cls, index: int, error: Any) -> Refusal:
        diag = error.diag
        return cls(
            index=index,
            sqlstate=error.sqlstate or "",
            constraint=diag.constraint_name,
            column=diag.column_name,
            message=diag.message_primary or str(error).strip(),
            detail=diag.message_detail,
        )

    def reason(self) -> str:
        """``column 'c'``/``constraint 'k'`` and the message, for an error text."""
        named = [f"column {self.column!r}"] if self.column else []
        named += [f"constraint {self.constraint!r}"] if self.constraint else []
        detail = f" {self.detail}" if self.detail else ""
        return f"{', '.join(named) + ': ' if named else ''}{self.message}.{detail}"


def is_refusal(error: BaseException) -> bool:
    """A PostgreSQL error that a row caused (class 22 or 23), not the server or the link."""
    sqlstate = getattr(error, "sqlstate", None) or ""
    return sqlstate[:2] in REFUSED_CLASSES


def find_refused(
    conn: Any,
    rows: pa.Table,
    write: Callable[[pa.Table], None],
    first_error: Any,
    first_only: bool,
) -> list[Refusal]:
    """Write ``rows`` (whose bulk write failed with ``first_error``) piece by piece in
    savepoints, halving each failing piece; the refused rows in row order. ``first_only``
    stops at the first (the batch fails anyway: only its name is needed)."""
    n = rows.num_rows
    if n == 1:
        return [Refusal.from_error(0, first_error)]
    refused: list[Refusal] = []
    half = n // 2
    pending = [(half, n - half), (0, half)]  # a stack: the leftmost piece on top
    while pending:
        start, length = pending.pop()
        try:
            with conn.transaction():
                write(rows.slice(start, length))
        except Exception as e:
            if not is_refusal(e):
                raise
            if length > 1:
                half = length // 2
                pending += [(start + half, length - half), (start, half)]
                continue
            refused.append(Refusal.from_error(start, e))
            if first_only:
                break
    return refused


def refused_table_name(table: TableName, given: str) -> TableName:
    """``given`` (``table`` or ``schema.table``; without a schema, the sink table's), or
    ``<table>_refused`` next to the sink's table."""
    if not given:
        return TableName(table.schema, table.table + REFUSED_SUFFIX)
    parts = given.split(".")
    return TableName(table.schema, given) if len(parts) == 1 else TableName(parts[0], parts[1])


def refused_table_statements(name: TableName) -> list[str]:
    """Create the refused table if missing: one row per refused row, with its
    coordinates, the row as JSON, and PostgreSQL's error."""
    return [
        f"CREATE TABLE IF NOT EXISTS {qualified(name)} ("
        "pipeline text NOT NULL, sink text NOT NULL, batch_id bigint NOT NULL, "
        "row_key json, row_json json NOT NULL, sqlstate text NOT NULL, "
        "constraint_name text, column_name text, message text NOT NULL, detail text, "
        "refused_at timestamptz NOT NULL DEFAULT now())",
        f"CREATE INDEX IF NOT EXISTS {quote(name.table + '_mb_batch')} "
        f"ON {qualified(name)} (pipeline, sink, batch_id)",
    ]


def record_refused(
    conn: Any,
    name: TableName,
    coordinates: tuple[str, str, int],
    key: Sequence[str],
    rows: pa.Table,
    refused: Sequence[Refusal],
) -> None:
    """Insert the refused rows (``coordinates``: pipeline, sink, batch id) in the
    caller's transaction: the batch's rows and its refused rows commit together."""
    if not refused:
        return
    taken = rows.drop_columns([BATCH_COLUMN]) if BATCH_COLUMN in rows.column_names else rows
    values = taken.take(pa.array([r.index for r in refused], pa.int64())).to_pylist()
    params = [
        (
            *coordinates,
            to_json({k: row[k] for k in key}) if key else None,
            to_json(row),
            r.sqlstate,
            r.constraint,
            r.column,
            r.message,
            r.detail,
        )
        for r, row in zip(refused, values, strict=True)
    ]
    with conn.cursor() as cur:
        cur.executemany(
            f"INSERT INTO {qualified(name)} (pipeline, sink, batch_id, row_key, row_json, "
            "sqlstate, constraint_name, column_name, message, detail) "
            "VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s)",
            params,
        )


def to_json(value: Any) -> str:
    """JSON text for the refused table's ``json`` columns (kept as written, so a string
    ``jsonb`` could not hold, e.g. with a NUL, still fits): dates and timestamps in ISO
    8601, decimals as strings (exact), bytes as base64."""
    return json.dumps(value, default=_json_default, ensure_ascii=False)


def _json_default(value: Any) -> Any:
    if isinstance(value, dt.date | dt.datetime | dt.time):
        return value.isoformat()
    if isinstance(value, decimal.Decimal):
        return str(value)
    if isinstance(value, bytes):
        return base64.b64encode(value).decode("ascii")
    if isinstance(value, dt.timedelta):
        return value.total_seconds()
    raise TypeError(f"{type(value).__name__} is not JSON serializable")
