"""Exactly-once PostgreSQL output: rows staged per instance, one transaction per batch.

**Stage** (each stage-2 task, before the checkpoint commits): the instance's rows, checked
against the declared schema (a NULL in a NOT NULL or key column fails the batch here,
before anything commits), become a Parquet file in the checkpoint store's staging area;
the table is created or checked (:mod:`microbatch.sinks.postgres_schema`) so a mismatch
also fails before the commit. Nothing is in the database yet.

**Publish** (the driver, after the commit): ONE PostgreSQL transaction that

1. takes a transaction-scoped advisory lock on the table (publishers of one table queue);
2. looks up the batch in ``<schema>.microbatch_commits`` (primary key: table, batch id) —
   a batch already there (a rerun after a crash, a zombie) writes nothing;
3. refuses a table another pipeline or sink already writes (one owner per table);
4. append mode: deletes the rows of the undone batches this batch supersedes (a backfill
   or replay), then COPYs the batch's rows in; upsert mode: keeps the last row per key
   (by instance, then emission order: deterministic), sorted by key, and COPYs them
   straight into the table when none of its keys is there yet (a savepoint: a key already
   there undoes the COPY), else into a temporary table, then ``INSERT ... ON CONFLICT
   (key) DO UPDATE``; a batch that needed the merge sends the next one straight to it;
   a row the table refuses (SQLSTATE class 22/23) undoes the bulk write (a savepoint);
   :mod:`microbatch.sinks.postgres_refused` then finds the refused rows, which fail the
   batch naming their key or, with ``on_refused="dead_letter"``, go to the refused
   table while the other rows are written;
5. inserts the batch's row into ``microbatch_commits`` and commits.

A reader sees a batch entirely or not at all. A crash or a lost connection anywhere rolls
the transaction back; the batch stays committed-unpublished and the next run publishes
it, once. Every row carries ``_microbatch_batch``, the batch that last wrote it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import io
import json
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from microbatch.datasets import DatasetRef
from microbatch.errors import ConfigError, ServiceError, SinkError
from microbatch.settings import Settings
from microbatch.sinks.base import (
    Awaiting,
    PublishContext,
    Sink,
    StageContext,
    Staged,
    conformed,
    rows_to_table,
)
from microbatch.sinks.parquet import encode_parquet
from microbatch.sinks.postgres_refused import (
    REFUSAL_MODES,
    Refusal,
    find_refused,
    is_refusal,
    record_refused,
    refused_table_name,
    refused_table_statements,
)
from microbatch.sinks.postgres_rows import concat, last_per_key
from microbatch.sinks.postgres_schema import (
    BATCH_COLUMN,
    Column,
    TableName,
    check_declared,
    create_statement,
    pg_type,
    plan_columns,
    qualified,
    quote,
)
from microbatch.sinks.postgres_write import TableWriter
from microbatch.validation import check_name

__all__ = ["COMMITS_TABLE", "MODES", "PostgresSink", "PostgresTarget"]

MODES = ("upsert", "append")
#: One row per published batch or rewind, in the schema of the table it writes.
COMMITS_TABLE = "microbatch_commits"
_CONNECT_TIMEOUT_S = 10


@dataclasses.dataclass(frozen=True)
class PostgresSink(Sink):
    """A PostgreSQL table kept exactly once: ``mode="upsert"`` keeps the latest row per
    ``key``; ``mode="append"`` adds every row (a backfill replaces the undone batches'
    rows).

    ``table`` is ``"table"`` or ``"schema.table"``; ``schema`` (a ``pyarrow.Schema``) its
    columns, from which the table is created when missing. ``dsn`` is a libpq connection
    string or URI; empty, the setting ``MICROBATCH_POSTGRES_DSN`` (masked in logs; from
    Airflow, the ``microbatch_postgres`` connection).

    A row the table refuses at publish (a CHECK or NOT NULL constraint, a value out of
    range) fails the batch naming table, column or constraint and the row's key
    (``on_refused="fail"``), or (``"dead_letter"``) goes with its coordinates and
    PostgreSQL's error to ``refused_table`` (default ``<table>_refused``), in the batch's
    transaction, while the batch's other rows are published.
    """

    name: str
    table: str
    schema: Any
    key: tuple[str, ...] = ()
    mode: str = "upsert"
    dsn: str = dataclasses.field(default="", repr=False)
    #: A publisher stalled inside its transaction longer than this loses it (PostgreSQL
    #: ends the session and rolls back), so a frozen zombie holding the table's lock
    #: delays the next run's publish by at most this long.
    stall_timeout_s: float = 60.0
    on_refused: str = "fail"
    refused_table: str = ""

    retractable = True

    def __post_init__(self) -> None:
        check_name("sink", self.name)
        if importlib.util.find_spec("psycopg") is None:
            raise ConfigError(
                f"sink {self.name!r}: the PostgreSQL sink needs psycopg 3 (pip install "
                "'microbatch[postgres]'; `make venv` installs it)"
            )
        if isinstance(self.key, str):
            object.__setattr__(self, "key", (self.key,))
        object.__setattr__(self, "key", tuple(self.key))
        if self.mode not in MODES:
            raise ConfigError(
                f"sink {self.name!r}: mode={self.mode!r}; use one of {', '.join(MODES)}"
            )
        if not isinstance(self.schema, pa.Schema):
            raise ConfigError(
                f"sink {self.name!r}: schema must be a pyarrow.Schema (the table's columns), "
                f"got {type(self.schema).__name__}"
            )
        TableName.parse(self.name, self.table)
        if not self.stall_timeout_s > 0:
            raise ConfigError(f"sink {self.name!r}: stall_timeout_s must be > 0 seconds")
        check_declared(self.name, self.schema, self.key, self.mode)
        if self.on_refused not in REFUSAL_MODES:
            raise ConfigError(
                f"sink {self.name!r}: on_refused={self.on_refused!r}; use one of "
                f"{', '.join(REFUSAL_MODES)}"
            )
        if self.refused_table:
            if self.on_refused != "dead_letter":
                raise ConfigError(
                    f"sink {self.name!r}: refused_table is where on_refused='dead_letter' "
                    "puts refused rows; set on_refused='dead_letter' or drop refused_table"
                )
            TableName.parse(self.name, self.refused_table)

    def target(self, settings: Settings | None, pipeline: str) -> PostgresTarget:
        return PostgresTarget(self, pipeline, settings or Settings.from_env())

    def stage(self, ctx: StageContext, rows: Sequence[Any]) -> Staged | None:
        return self.stage_table(ctx, rows_to_table(self.name, rows, self.schema))

    def stage_columns(self, ctx: StageContext, table: pa.Table) -> Staged | None:
        return self.stage_table(ctx, conformed(self.name, table, self.schema))

    def stage_table(self, ctx: StageContext, table: pa.Table) -> Staged | None:
        if table.num_rows == 0:
            return None
        target = self.target(ctx.settings, ctx.pipeline)
        if target.dead_letters:
            table = concat([table], target.rows_schema)
        target.check_rows(table, ctx.batch_id)
        with target.connect() as conn, conn.transaction():
            target.prepare(conn)  # a table that does not fit fails before the commit
        key = ctx.layout.staging_key(ctx.batch_id, self.name, ctx.instance, ctx.attempt)
        ctx.checkpoint_store.put(key, encode_parquet(table))
        return Staged(key, table.num_rows)

    def publish(self, ctx: PublishContext) -> None:
        staged = sorted(ctx.staged, key=lambda s: s.file)  # instance order
        tables = [pq.read_table(io.BytesIO(ctx.checkpoint_store.get(s.file))) for s in staged]
        self.target(ctx.settings, ctx.pipeline).publish(
            ctx.batch_id, tables, ctx.end_offsets, ctx.supersedes
        )

    def publish_rewind(self, ctx: PublishContext, undone: Sequence[int]) -> None:
        self.target(ctx.settings, ctx.pipeline).publish_rewind(ctx.batch_id, undone)

    def awaiting_replacement(self, settings: Settings, undone: Sequence[int]) -> Awaiting:
        if self.mode == "upsert" and self.on_refused == "fail":
            return {}  # replayed batches overwrite their keys' rows; nothing to remove
        return self.target(settings, "").awaiting_replacement(undone)

    def dataset(self, settings: Settings) -> DatasetRef:
        from psycopg.conninfo import conninfo_to_dict

        info = conninfo_to_dict(self.dsn or settings.postgres_dsn)
        host, port = info.get("host") or "localhost", info.get("port") or 5432
        name = TableName.parse(self.name, self.table)
        return DatasetRef(f"postgres://{host}:{port}", f"{info.get('dbname', '')}.{name}")

    def last_published(self, settings: Settings, pipeline: str) -> int | None:
        return self.target(settings, pipeline).last_published()


class PostgresTarget:
    """The sink's table as one pipeline sees it: connection, names, and the SQL."""

    def __init__(self, sink: PostgresSink, pipeline: str, settings: Settings) -> None:
        self.sink = sink
        self.pipeline = pipeline
        self.dsn = sink.dsn or settings.postgres_dsn
        self.name = TableName.parse(sink.name, sink.table)
        self.commits = f"{quote(self.name.schema)}.{quote(COMMITS_TABLE)}"
        self.dead_letters = sink.on_refused == "dead_letter"
        self.refused = refused_table_name(self.name, sink.refused_table)
        #: The rows' schema on their way: with dead letters, a NULL in a NOT NULL column
        #: travels to publish, where the table refuses its row.
        self.rows_schema = pa.schema(
            [f.with_nullable(True) if f.name not in sink.key else f for f in sink.schema]
            if self.dead_letters
            else sink.schema
        )
        owner = f"pipeline {pipeline!r} " if pipeline else ""
        self.where = f"{owner}sink {sink.name!r} (PostgreSQL table {self.name})"
        if not self.dsn:
            raise ConfigError(
                f"{self.where}: no database to connect to; give the sink dsn=... or set "
                "MICROBATCH_POSTGRES_DSN (Airflow: the microbatch_postgres connection)"
            )

    @contextlib.contextmanager
    def connect(self) -> Iterator[Any]:
        """A connection (closed on exit); a server that does not answer is a
        :class:`ServiceError` (retry: a committed batch is published by the next run)."""
        import psycopg

        try:
            conn = psycopg.connect(
                self.dsn,
                connect_timeout=_CONNECT_TIMEOUT_S,
                application_name=f"microbatch {self.pipeline}"[:63],
            )
        except psycopg.OperationalError as e:
            raise ServiceError(
                f"{self.where}: PostgreSQL did not answer ({str(e).strip()}); check the "
                "server and the DSN, then run again (a committed batch is published then)"
            ) from e
        try:
            conn.execute(
                "SELECT set_config('idle_in_transaction_session_timeout', %s, false)",
                (str(max(1, int(self.sink.stall_timeout_s * 1000))),),
            )
            conn.commit()
            yield conn
        finally:
            conn.close()

    # Table and ownership ---------------------------------------------------------------
    def prepare(self, conn: Any) -> None:
        """In the caller's transaction: lock the table's publishers, create the commits
        table and the table if missing, check (and add nullable) columns, check the owner."""
        conn.execute("SELECT pg_advisory_xact_lock(hashtext(%s))", (f"microbatch:{self.name}",))
        conn.execute(
            f"CREATE TABLE IF NOT EXISTS {self.commits} ("
            "target text NOT NULL, batch_id bigint NOT NULL, pipeline text NOT NULL, "
            "sink text NOT NULL, kind text NOT NULL, rows bigint NOT NULL, "
            "end_offsets jsonb, supersedes bigint[] NOT NULL, undoes bigint[] NOT NULL, "
            "method text, "
            "committed_at timestamptz NOT NULL DEFAULT now(), PRIMARY KEY (target, batch_id))"
        )
        columns = self._columns(conn)
        if not columns:
            conn.execute(
                create_statement(self.name, self.sink.schema, self.sink.key, self.sink.mode)
            )
            if self.sink.mode == "append":
                conn.execute(
                    f"CREATE INDEX IF NOT EXISTS {quote(self.name.table + '_mb_batch')} "
                    f"ON {qualified(self.name)} ({quote(BATCH_COLUMN)})"
                )
        else:
            add = plan_columns(
                self.where,
                columns,
                self.sink.schema,
                self.sink.key,
                self._unique_keys(conn),
                self.sink.mode,
            )
            for field in add:
                conn.execute(
                    f"ALTER TABLE {qualified(self.name)} ADD COLUMN IF NOT EXISTS "
                    f"{quote(field.name)} {pg_type(self.sink.name, field)}"
                )
        if self.dead_letters and not self._exists(conn, qualified(self.refused)):
            for statement in refused_table_statements(self.refused):
                conn.execute(statement)
        if self.pipeline:
            self._check_owner(conn)

    def _columns(self, conn: Any) -> dict[str, Column]:
        rows = conn.execute(
            "SELECT a.attname, format_type(a.atttypid, a.atttypmod), a.attnotnull "
            "FROM pg_attribute a JOIN pg_class c ON c.oid = a.attrelid "
            "JOIN pg_namespace n ON n.oid = c.relnamespace "
            "WHERE n.nspname = %s AND c.relname = %s AND a.attnum > 0 "
            "AND NOT a.attisdropped ORDER BY a.attnum",
            (self.name.schema, self.name.table),
        ).fetchall()
        return {name: Column(name, type_, not_null) for name, type_, not_null in rows}

    def _unique_keys(self, conn: Any) -> list[frozenset[str]]:
        rows = conn.execute(
            "SELECT array_agg(a.attname) FROM pg_index i "
            "JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = ANY(i.indkey) "
            "WHERE i.indrelid = %s::regclass AND i.indisunique AND i.indpred IS NULL "
            "GROUP BY i.indexrelid",
            (qualified(self.name),),
        ).fetchall()
        return [frozenset(cols) for (cols,) in rows]

    def _check_owner(self, conn: Any) -> None:
        other = conn.execute(
            f"SELECT pipeline, sink FROM {self.commits} WHERE target = %s "
            "AND (pipeline, sink) <> (%s, %s) LIMIT 1",
            (str(self.name), self.pipeline, self.sink.name),
        ).fetchone()
        if other:
            raise ConfigError(
                f"{self.where}: the table is already written by pipeline {other[0]!r} "
                f"(sink {other[1]!r}); two writers would replace and skip each other's "
                "batches. Give each pipeline sink its own table (a view can union them)."
            )

    # Reading ---------------------------------------------------------------------------
    def _history(self, conn: Any) -> list[tuple[Any, ...]]:
        if not self._has_commits_table(conn):
            return []
        return conn.execute(
            f"SELECT batch_id, pipeline, kind, rows, end_offsets, supersedes, undoes "
            f"FROM {self.commits} WHERE target = %s ORDER BY batch_id",
            (str(self.name),),
        ).fetchall()

    def _has_commits_table(self, conn: Any) -> bool:
        return self._exists(conn, self.commits)

    @staticmethod
    def _exists(conn: Any, qualified_name: str) -> bool:
        found = conn.execute("SELECT to_regclass(%s)", (qualified_name,)).fetchone()
        return found is not None and found[0] is not None

    def last_published(self) -> int | None:
        """This pipeline's newest published batch; refuses a table another pipeline
        writes (asked before a pipeline's first batch: refused before any work)."""
        with self.connect() as conn:
            if not self._has_commits_table(conn):
                return None
            self._check_owner(conn)
            row = conn.execute(
                f"SELECT max(batch_id) FROM {self.commits} WHERE target = %s AND pipeline = %s "
                "AND sink = %s",
                (str(self.name), self.pipeline, self.sink.name),
            ).fetchone()
            return None if row is None or row[0] is None else int(row[0])

    def published(self) -> list[int]:
        """The batches (not rewinds) published into the table, oldest first."""
        with self.connect() as conn:
            return [int(r[0]) for r in self._history(conn) if r[2] == "batch"]

    def awaiting_replacement(self, undone: Sequence[int]) -> Awaiting:
        """Undone batches (``undone`` and those earlier rewinds undid) whose rows (append
        mode) or refused rows are still in the tables → their end offsets."""
        with self.connect() as conn:
            history = self._history(conn)
            undone_all = set(undone)
            replaced: set[int] = set()
            for _, _, _, _, _, supersedes, undoes in history:
                undone_all.update(undoes)
                replaced.update(supersedes)
            with_refused = self._batches_with_refused(conn, sorted(undone_all - replaced))
        append = self.sink.mode == "append"
        return {
            str(batch): dict(ends or {})
            for batch, _, kind, rows, ends, _, _ in history
            if kind == "batch"
            and batch in undone_all
            and batch not in replaced
            and ((append and rows > 0) or batch in with_refused)
        }

    def _batches_with_refused(self, conn: Any, batches: Sequence[int]) -> set[int]:
        if not (batches and self.dead_letters and self._exists(conn, qualified(self.refused))):
            return set()
        found = conn.execute(
            f"SELECT DISTINCT batch_id FROM {qualified(self.refused)} "
            "WHERE sink = %s AND batch_id = ANY(%s)",
            (self.sink.name, list(batches)),
        ).fetchall()
        return {int(b) for (b,) in found}

    # Writing ---------------------------------------------------------------------------
    def check_rows(self, table: pa.Table, batch_id: int) -> None:
        """NULLs where the table cannot hold them fail the batch before it commits (but
        for a non-key column with ``on_refused="dead_letter"``: the table refuses the row
        at publish, and it goes to the refused table)."""
        for field in self.sink.schema:
            if field.name not in self.sink.key and (field.nullable or self.dead_letters):
                continue
            col = table.column(field.name)
            if col.null_count:
                first = pc.index(pc.is_null(col), True).as_py()
                raise SinkError(
                    f"{self.where}: batch {batch_id}: column {field.name!r} is NULL in "
                    f"{col.null_count} row(s) but the table needs a value (NOT NULL"
                    f"{' key' if field.name in self.sink.key else ''}); first: "
                    f"{table.slice(first, 1).to_pylist()[0]!r:.300}"
                )

    def publish(
        self,
        batch_id: int,
        tables: Sequence[pa.Table],
        end_offsets: Mapping[str, int] | None = None,
        supersedes: Sequence[int] = (),
    ) -> bool:
        """Publish batch ``batch_id`` in one transaction; False if it already was (or has
        nothing to show: an idle batch needs no database)."""
        rows = concat(tables, self.rows_schema)
        if rows.num_rows == 0 and not supersedes:
            return False
        if self.sink.mode == "upsert":
            rows = last_per_key(rows, self.sink.key)
        with self.connect() as conn, conn.transaction():
            # deferred constraints too are checked per statement, where a refused row
            # can still be told from the others (at COMMIT it could only fail the batch)
            conn.execute("SET CONSTRAINTS ALL IMMEDIATE")
            self.prepare(conn)
            if self._is_committed(conn, batch_id):
                return False
            self._remove_superseded(conn, supersedes)
            method, refused = self._write(conn, rows, batch_id) if rows.num_rows else (None, [])
            coordinates = (self.pipeline, self.sink.name, batch_id)
            record_refused(conn, self.refused, coordinates, self.sink.key, rows, refused)
            written = rows.num_rows - len(refused)
            self._record(conn, batch_id, "batch", written, end_offsets, supersedes, (), method)
            from microbatch.runtime.faults import pause_if  # the kill-and-race tests' hook

            pause_if("in_postgres_transaction", f"{self.where} batch {batch_id}")
        return True

    def _remove_superseded(self, conn: Any, supersedes: Sequence[int]) -> None:
        """A backfill: the rows (append mode) and refused rows of the undone batches this
        one read the input of again go, in its transaction."""
        if not supersedes:
            return
        if self.sink.mode == "append":
            conn.execute(
                f"DELETE FROM {qualified(self.name)} WHERE {quote(BATCH_COLUMN)} = ANY(%s)",
                (list(supersedes),),
            )
        if self.dead_letters:
            conn.execute(
                f"DELETE FROM {qualified(self.refused)} WHERE pipeline = %s AND sink = %s "
                "AND batch_id = ANY(%s)",
                (self.pipeline, self.sink.name, list(supersedes)),
            )

    def publish_rewind(self, batch_id: int, undone: Sequence[int]) -> bool:
        """Record that checkpoint ``batch_id`` undoes ``undone``: their rows stay until the
        batches that read their input again replace them."""
        with self.connect() as conn, conn.transaction():
            self.prepare(conn)
            if self._is_committed(conn, batch_id):
                return False
            self._record(conn, batch_id, "rewind", 0, None, (), undone, None)
        return True

    def _is_committed(self, conn: Any, batch_id: int) -> bool:
        return (
            conn.execute(
                f"SELECT 1 FROM {self.commits} WHERE target = %s AND batch_id = %s",
                (str(self.name), batch_id),
            ).fetchone()
            is not None
        )

    def _record(
        self,
        conn: Any,
        batch_id: int,
        kind: str,
        rows: int,
        end_offsets: Mapping[str, int] | None,
        supersedes: Sequence[int],
        undoes: Sequence[int],
        method: str | None,
    ) -> None:
        conn.execute(
            f"INSERT INTO {self.commits} (target, batch_id, pipeline, sink, kind, rows, "
            "end_offsets, supersedes, undoes, method) "
            "VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s)",
            (
                str(self.name),
                batch_id,
                self.pipeline,
                self.sink.name,
                kind,
                rows,
                None if end_offsets is None else json.dumps(dict(end_offsets)),
                sorted(supersedes),
                sorted(undoes),
                method,
            ),
        )

    def _write(self, conn: Any, rows: pa.Table, batch_id: int) -> tuple[str, list[Refusal]]:
        """Write the batch's rows in bulk; how (``copy``: straight into the table,
        ``merge``: through a temporary table and ``ON CONFLICT``) is recorded with the
        batch. A row the table refuses undoes the bulk write; then the refused rows are
        found, and fail the batch or (``on_refused="dead_letter"``) come back, the
        other rows written."""
        import psycopg

        batch_column = pa.repeat(pa.scalar(batch_id, pa.int64()), len(rows))
        rows = rows.append_column(BATCH_COLUMN, batch_column)
        writer = TableWriter(conn, self.sink.name, self.name, self.sink.schema, self.sink.key)
        try:
            with conn.transaction():  # a savepoint: a refused row undoes this write only
                return self._write_bulk(conn, writer, rows), []
        except psycopg.Error as e:
            if not is_refusal(e):
                raise
            first_error = e
        if self.sink.mode == "append":
            method, write_piece = "copy", writer.copy
        else:
            writer.create_stage()
            method, write_piece = "merge", writer.merge_piece
        refused = find_refused(conn, rows, write_piece, first_error, not self.dead_letters)
        if refused and not self.dead_letters:
            raise self._row_error(batch_id, rows, refused[0])
        return method, refused

    def _write_bulk(self, conn: Any, writer: TableWriter, rows: pa.Table) -> str:
        import psycopg

        if self.sink.mode == "append":
            writer.copy(rows)
            return "copy"
        if self._last_method(conn) != "merge" and not writer.keys_present(rows):
            # Keys the table does not have yet (events with ids, a first load): a plain
            # COPY is ~2x faster than a merge. A key already there rolls it back.
            try:
                with conn.transaction():
                    writer.copy(rows)
                return "copy"
            except psycopg.errors.UniqueViolation:
                pass
        writer.merge(rows)
        return "merge"

    def _last_method(self, conn: Any) -> str | None:
        """How the previous batch was written: a merge predicts keys seen again."""
        row = conn.execute(
            f"SELECT method FROM {self.commits} WHERE target = %s AND kind = 'batch' "
            "ORDER BY batch_id DESC LIMIT 1",
            (str(self.name),),
        ).fetchone()
        return None if row is None else row[0]

    def _row_error(self, batch_id: int, rows: pa.Table, refusal: Refusal) -> SinkError:
        row = rows.drop_columns([BATCH_COLUMN]).slice(refusal.index, 1).to_pylist()[0]
        which = (
            f"the row with key { ({k: row[k] for k in self.sink.key})!r:.300}"
            if self.sink.key
            else f"the row {row!r:.300}"
        )
        return SinkError(
            f"{self.where}: batch {batch_id}: the table refuses {which}: {refusal.reason()}"
            " The batch is committed but not published; fix the table or the pipeline's "
            "output, then run again (or give the sink on_refused='dead_letter' to set such "
            "rows aside and publish the others)."
        )
