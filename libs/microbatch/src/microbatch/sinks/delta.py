"""Exactly-once Delta Lake output: Parquet files staged per instance, one Delta commit per
batch carrying an app transaction.

**Stage** (each stage-2 task, before the checkpoint commits): the instance's rows become
Parquet files in the table's folder (one per partition value), named after the app, the
batch, the instance and the attempt — ``mb-<app>-b<batch>-i<instance>-<n>-<attempt>.parquet``
under the Hive-style partition folders — so the same rows give the same bytes and no
attempt overwrites another's files. A small JSON index of what was written (path, size,
partition values, stats) goes to the checkpoint store's staging area (removed by the
checkpoint GC); the batch record names it. Nothing is in the Delta log yet: readers see
nothing.

**Publish** (the driver, after the commit): ONE Delta commit that adds the batch's files,
removes the files of the undone batches it supersedes (a backfill or replay), and carries
the app transaction ``txn {appId: "<pipeline>/<sink>", version: <batch id>}``. Before
committing, the snapshot's transaction version for the app is read: a batch already there
(a rerun after a crash, a zombie) commits nothing. Two publishers racing on one batch both
try to create the same next log entry; the object store's conditional create lets one win,
and the loser's conflict check sees the winner's ``txn`` for the same app and fails; it
re-reads and finds the batch published. A commit by another writer in between (optimistic
concurrency) is re-read and retried on the new version, by delta-rs and then by this module
(a fresh snapshot, the transaction version checked again).

Why the ``deltalake`` package (delta-rs) rather than writing ``_delta_log`` entries here:
its 1.x transaction API commits arbitrary add *and* remove actions plus app transactions
in one commit (``DeltaTable.create_write_transaction`` with ``CommitProperties``), its
S3 log store creates commit files with ``If-None-Match: *`` (no DynamoDB lock, verified on
SeaweedFS), and its conflict checker rejects a concurrent commit of the same app
transaction. Using it keeps the log, the checkpoints every 100 versions and the protocol
versions right for every Delta reader, instead of a second Delta writer to maintain. One
exception, found by a race test: delta-rs's table creation, on finding version 0 taken,
commits its CREATE (with the batch) as version 1 without a conflict check, so two first
batches racing would both land. The table is therefore created empty, as version 0, by
this module: the entry delta-rs builds in a scratch folder, written with the store's
exclusive create (exactly one racing creator wins); data commits start at version 1.

**Schema** (``schema``, a ``pyarrow.Schema``, is required): checked against the table's
before the first file of a batch is written (a stage-2 task, before the commit) and again
before each commit. A nullable column the table lacks is added (a metaData commit of its
own, right before the batch's data commit); a type change, a non-null column the sink drops
or a new non-null column fail with a :class:`SinkError` naming the pipeline, the sink and
the column. A location that holds files but no Delta log is refused.

Replacement. Each data commit records its end offsets in ``commitInfo`` (``microbatch``:
``batch``, ``end_offsets``, ``supersedes``); a rewind commits a data-less version naming
the batches it ``undoes``. Only a rewind reads the history (:meth:`awaiting_replacement`);
a batch's files are found in the current snapshot by their names.

One pipeline per table: its first commit records it in ``_microbatch/owner.json``
(exclusive create); :meth:`DeltaSink.last_published` and every commit refuse another. The
rewind and GC hooks get no pipeline, and the owner tells them whose batches are whose.

Maintenance (``microbatch optimize``): :meth:`DeltaTarget.optimize` merges each batch's
files per partition (``dataChange: false``; names keep the batch, so replacement still
works, and say ``merged-``, so no GC takes them for an attempt's), checking the lease right
before its commit; :meth:`DeltaTarget.vacuum` deletes old unreferenced files; the checkpoint
GC's :meth:`DeltaSink.collect_orphans` deletes only files of attempts that lost a batch's
commit (never one a table version references).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
from collections.abc import Sequence
from typing import Any

import pyarrow as pa

from microbatch.datasets import DatasetRef, url_dataset
from microbatch.errors import ConfigError
from microbatch.settings import Settings
from microbatch.sinks.base import (
    Awaiting,
    PublishContext,
    Sink,
    StageContext,
    Staged,
    conformed,
    partition_columns,
    rows_to_table,
)
from microbatch.sinks.delta_files import staged_files, storage_options, table_location
from microbatch.sinks.delta_schema import SchemaChange, plan_schema
from microbatch.sinks.delta_target import DeltaTarget
from microbatch.validation import check_name

__all__ = [
    "DeltaSink",
    "DeltaTarget",
    "SchemaChange",
    "plan_schema",
    "read_delta_sink",
]


@dataclasses.dataclass(frozen=True)
class DeltaSink(Sink):
    """A Delta Lake table at ``table_uri`` (a path, ``file:///dir`` or
    ``s3://bucket/prefix``), one commit per batch, exactly once.

    ``schema`` is the table's ``pyarrow.Schema`` (required: it is checked against the
    table before a batch commits); ``partition_by`` names string, integer, boolean or date
    columns of it. Read with any Delta reader (Spark, delta-rs, Polars, DuckDB). One
    pipeline writes the table (the first to commit; another is refused).
    """

    name: str
    table_uri: str
    schema: Any
    partition_by: tuple[str, ...] = ()

    retractable = True

    def __post_init__(self) -> None:
        check_name("sink", self.name)
        if not self.table_uri:
            raise ConfigError(f"sink {self.name!r}: table_uri is empty")
        if importlib.util.find_spec("deltalake") is None:
            raise ConfigError(
                f"sink {self.name!r}: the Delta sink needs the deltalake package "
                "(pip install deltalake==1.6.6; `make venv` installs it)"
            )
        if not isinstance(self.schema, pa.Schema):
            raise ConfigError(
                f"sink {self.name!r}: schema must be a pyarrow.Schema (the Delta table's "
                f"columns), got {type(self.schema).__name__}"
            )
        columns = partition_columns(self.name, self.schema, self.partition_by)
        object.__setattr__(self, "partition_by", columns)

    def target(self, settings: Settings | None, pipeline: str) -> DeltaTarget:
        return DeltaTarget(self, pipeline, settings)

    def stage(self, ctx: StageContext, rows: Sequence[Any]) -> Staged | None:
        return self.stage_table(ctx, rows_to_table(self.name, rows, self.schema))

    def stage_columns(self, ctx: StageContext, table: pa.Table) -> Staged | None:
        return self.stage_table(ctx, conformed(self.name, table, self.schema))

    def stage_table(self, ctx: StageContext, table: pa.Table) -> Staged | None:
        if table.num_rows == 0:
            return None
        target = self.target(ctx.settings, ctx.pipeline)
        target.check_schema()  # before anything is written or committed
        files = target.write_files(table, ctx.batch_id, ctx.instance, ctx.attempt)
        key = (
            f"{ctx.layout.staging_dir(ctx.batch_id)}{self.name}/"
            f"part-{ctx.instance:05d}-{ctx.attempt}.json"
        )
        ctx.checkpoint_store.put(key, json.dumps({"files": files}, sort_keys=True).encode())
        return Staged(key, table.num_rows)

    def publish(self, ctx: PublishContext) -> None:
        files = [f for s in ctx.staged for f in staged_files(ctx.checkpoint_store, s.file)]
        self.target(ctx.settings, ctx.pipeline).publish(
            ctx.batch_id, files, ctx.end_offsets, ctx.supersedes
        )

    def publish_rewind(self, ctx: PublishContext, undone: Sequence[int]) -> None:
        self.target(ctx.settings, ctx.pipeline).publish_rewind(ctx.batch_id, undone)

    def awaiting_replacement(self, settings: Settings, undone: Sequence[int]) -> Awaiting:
        # This hook gets no pipeline: the table's one writer is the one rewinding.
        return self.owners_target(settings).awaiting_replacement(undone)

    def collect_orphans(self, settings: Settings, batches: Sequence[int]) -> int:
        return self.owners_target(settings).collect_orphans(batches)

    def owners_target(self, settings: Settings) -> DeltaTarget:
        """The table as the pipeline recorded as its writer sees it, for the hooks that get
        no pipeline (before the first commit recorded one: matching every app's files)."""
        return DeltaTarget(self, DeltaTarget(self, None, settings).owner(), settings)

    def shared_storage_url(self) -> str | None:
        return self.table_uri

    def dataset(self, settings: Settings) -> DatasetRef:
        return url_dataset(self.table_uri)

    def last_published(self, settings: Settings, pipeline: str) -> int | None:
        return self.target(settings, pipeline).last_published()


def read_delta_sink(uri: str, settings: Settings | None = None) -> pa.Table:
    """The table's current rows (delta-rs), for tests and tools."""
    from deltalake import DeltaTable

    settings = settings or Settings.from_env()
    dt = DeltaTable(table_location(uri), storage_options=storage_options(uri, settings))
    return pa.table(dt.to_pyarrow_table())
