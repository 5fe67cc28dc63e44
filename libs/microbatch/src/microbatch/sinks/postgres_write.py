"""How the PostgreSQL sink's rows get into its table, inside the publish transaction.

``copy`` sends the rows straight into the table (append mode; an upsert whose keys are
all new). ``merge`` sends them to a temporary table, then ``INSERT ... ON CONFLICT (key)
DO UPDATE`` (the upsert of keys already there). :meth:`TableWriter.keys_present` looks a
sample of the batch's keys up first, so a batch of keys the table has goes straight to
the merge instead of paying for a ``COPY`` that the first such key rolls back.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pyarrow as pa

from microbatch.sinks.postgres_rows import csv_bytes
from microbatch.sinks.postgres_schema import TableName, pg_type, qualified, quote

#: Rows per CSV slice sent to COPY.
COPY_SLICE_ROWS = 50_000
#: Keys of a batch looked up before trying a plain COPY (evenly spaced, first and last
#: included): one index probe each, a few milliseconds.
KEY_SAMPLE = 64


class TableWriter:
    """Writes rows (the sink's columns and the batch column) into ``table`` on ``conn``."""

    def __init__(
        self, conn: Any, sink: str, table: TableName, schema: pa.Schema, key: Sequence[str]
    ) -> None:
        self.conn = conn
        self.sink = sink
        self.table = qualified(table)
        self.schema = schema
        self.key = tuple(key)
        self.stage = quote(f"mb_stage_{sink}")

    def _columns(self, rows: pa.Table) -> str:
        return ", ".join(quote(n) for n in rows.column_names)

    def copy(self, rows: pa.Table, into: str | None = None) -> None:
        """COPY ``rows`` in slices: the server inserts one while the next is encoded (two
        processes: ~25% less time than encoding everything first)."""
        statement = f"COPY {into or self.table} ({self._columns(rows)}) FROM STDIN (FORMAT csv)"
        with self.conn.cursor().copy(statement) as copy:
            for batch in rows.to_batches(max_chunksize=COPY_SLICE_ROWS):
                copy.write(csv_bytes(pa.Table.from_batches([batch])))

    def create_stage(self) -> None:
        """The session's staging table, shaped like the table, gone at commit."""
        self.conn.execute(
            f"CREATE TEMP TABLE IF NOT EXISTS {self.stage} (LIKE {self.table}) ON COMMIT DROP"
        )

    def merge(self, rows: pa.Table) -> None:
        """Upsert ``rows`` (one per key) through the staging table."""
        self.create_stage()
        self.copy(rows, into=self.stage)
        cols = self._columns(rows)
        keys = ", ".join(quote(k) for k in self.key)
        updates = ", ".join(
            f"{quote(n)} = EXCLUDED.{quote(n)}" for n in rows.column_names if n not in self.key
        )
        self.conn.execute(
            f"INSERT INTO {self.table} ({cols}) SELECT {cols} FROM {self.stage} "
            f"ON CONFLICT ({keys}) DO UPDATE SET {updates}"
        )

    def merge_piece(self, rows: pa.Table) -> None:
        """:meth:`merge`, leaving the staging table empty for the next piece."""
        self.merge(rows)
        self.conn.execute(f"TRUNCATE {self.stage}")

    def keys_present(self, rows: pa.Table) -> bool:
        """Whether the table has any of a sample of the keys of ``rows``. False says
        little (an unsampled key may be there); True says a plain COPY would fail."""
        fields = [self.schema.field(k) for k in self.key]
        types = [pg_type(self.sink, f) for f in fields]
        if any(t.endswith("[]") for t in types):
            return False  # an array key: unnest would flatten it; let the COPY find out
        n = rows.num_rows
        picks = sorted({i * (n - 1) // max(1, KEY_SAMPLE - 1) for i in range(KEY_SAMPLE)})
        sample = rows.select(list(self.key)).take(pa.array(picks, pa.int64()))
        arrays = ", ".join(f"%s::{t}[]" for t in types)
        matches = " AND ".join(f"t.{quote(k)} = s.k{i}" for i, k in enumerate(self.key))
        found = self.conn.execute(
            f"SELECT EXISTS (SELECT 1 FROM unnest({arrays}) AS s("
            + ", ".join(f"k{i}" for i in range(len(self.key)))
            + f") JOIN {self.table} t ON {matches})",
            [sample.column(k).to_pylist() for k in self.key],
        ).fetchone()
        return bool(found and found[0])
