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

import contextlib
import dataclasses
import hashlib
import importlib.util
import json
import logging
import re
import tempfile
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import quote, unquote, urlparse

import pyarrow as pa
import pyarrow.compute as pc

from microbatch.datasets import DatasetRef, url_dataset
from microbatch.errors import ConfigError, SinkError
from microbatch.settings import Settings
from microbatch.sinks.base import (
    Awaiting,
    PublishContext,
    Sink,
    StageContext,
    Staged,
    partition_columns,
    rows_to_table,
)
from microbatch.sinks.parquet import encode_parquet
from microbatch.storage import AlreadyExistsError, ObjectNotFoundError, ObjectStore, open_store
from microbatch.validation import check_name

log = logging.getLogger(__name__)

__all__ = [
    "DeltaSink",
    "DeltaTarget",
    "SchemaChange",
    "plan_schema",
    "read_delta_sink",
]

#: Commits re-read and retried after a conflict before publishing gives up.
MAX_ATTEMPTS = 8
_NULL_PARTITION = "__HIVE_DEFAULT_PARTITION__"
FIRST_ENTRY = f"{0:020d}.json"
#: A data file of a batch: staged by an attempt (``-<n>-<attempt>``), or an optimize's
#: merge of a batch's files (``-0000-merged-v<version>_<token>``), which no attempt's id
#: can spell ('-' is not in an id), so the GC of losing attempts never takes one for theirs.
_FILE = re.compile(
    r"(?:^|/)mb-(?P<app>[0-9a-f]{8})-b(?P<batch>\d{20})-i(?P<instance>\d{5})-\d{4}-"
    r"(?:merged-(?P<merged>\w+)|(?P<attempt>\w+))\.parquet$"
)
#: Merged files before they had names of their own: ``-0000-c<version>``.
_OLD_MERGED = re.compile(r"c\d+")
#: The pipeline that writes the table (created once, exclusively, by its first commit).
#: Under ``_``: Delta readers and VACUUM skip such paths.
OWNER = "_microbatch/owner.json"


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


class DeltaTarget:
    """The sink's table as one pipeline sees it: where it is and what its app id is."""

    def __init__(self, sink: DeltaSink, pipeline: str | None, settings: Settings | None) -> None:
        self.sink = sink
        self.pipeline = pipeline
        self.settings = settings or Settings.from_env()
        self.uri = table_location(sink.table_uri)
        self.options = storage_options(sink.table_uri, self.settings)
        self.app_id = f"{pipeline}/{sink.name}"
        owner = f"pipeline {pipeline!r} " if pipeline is not None else ""
        self.where = f"{owner}sink {sink.name!r} (Delta table {sink.table_uri})"

    # Reading -----------------------------------------------------------------------------
    def store(self) -> ObjectStore:
        return open_store(self.sink.table_uri, self.settings)

    def load(self) -> Any:
        """The newest snapshot, or None when there is no Delta table yet (a location with
        other files is refused: nothing there may be mistaken for the table)."""
        from deltalake import DeltaTable
        from deltalake.exceptions import TableNotFoundError

        try:
            return DeltaTable(self.uri, storage_options=self.options)
        except TableNotFoundError:
            pass
        foreign = [
            k
            for k in self.store().list("")
            if not (_FILE.search(k) or k.startswith("_microbatch/"))
        ]
        if foreign:
            raise SinkError(
                f"{self.where}: the location holds files but no Delta table (no "
                f"_delta_log/; e.g. {foreign[0]!r}). Point the sink to an empty location, or "
                "convert the Parquet data there to Delta first "
                "(deltalake.convert_to_deltalake)."
            )
        return None

    def check_schema(self, snapshot: Any = None) -> SchemaChange:
        """The schema change the next commit makes (nothing for a new table)."""
        try:  # here, not when the pipeline is built: importing deltalake costs ~0.1 s
            delta_fields(self.sink.schema)
        except Exception as e:
            raise SinkError(
                f"{self.where}: the schema has no Delta equivalent "
                f"({str(e).splitlines()[0] if str(e) else e!r}); use types Delta "
                "has (string, integers, floats, boolean, date, timestamp, decimal, lists, "
                "structs, maps)"
            ) from e
        dt = snapshot if snapshot is not None else self.load()
        if dt is None:
            return SchemaChange()
        meta = dt.metadata()
        fields = json.loads(dt.schema().to_json())["fields"]
        return plan_schema(
            self.where, fields, meta.partition_columns, self.sink.schema, self.sink.partition_by
        )

    def last_published(self) -> int | None:
        """This app's newest committed batch; refuses a table another pipeline writes (the
        runtime asks before a pipeline's first batch: refused before any work)."""
        dt = self.load()
        if dt is None:
            return None
        self.check_owner(dt)
        return dt.transaction_version(self.app_id)

    # Ownership ---------------------------------------------------------------------------
    # One pipeline per table: batch ids are each pipeline's own, and a rewind or the GC of
    # one pipeline cannot tell its batches from another's in the log (their hooks get no
    # pipeline). The first commit records the writer; every later commit checks it.
    def owner(self) -> str | None:
        """The pipeline recorded as the table's writer; None before the first commit."""
        try:
            return str(json.loads(self.store().get(OWNER))["pipeline"])
        except ObjectNotFoundError:
            return None

    def check_owner(self, snapshot: Any = None) -> str | None:
        """Refuse a table another pipeline writes: the recorded owner, or (a table written
        before owners were recorded, with ``snapshot``) a pipeline in its history. Returns
        the recorded owner."""
        owner = self.owner()
        if owner is not None:
            writers, seen_in = {owner}, f"{self.sink.table_uri}/{OWNER}"
        elif snapshot is not None:
            writers, seen_in = pipelines_in_history(snapshot), "its Delta log"
        else:
            return None
        others = sorted(writers - {self.pipeline})
        if others:
            raise ConfigError(
                f"{self.where}: the table is written by pipeline {others[0]!r} (as {seen_in} "
                f"says), so pipeline {self.pipeline!r} must not write it: batch ids are each "
                "pipeline's own, and one pipeline's rewinds and clean-up would remove or "
                f"delete the other's files. Give the sink of pipeline {self.pipeline!r} a "
                "Delta table of its own (a view can union the two)."
            )
        return owner

    def claim(self, snapshot: Any) -> None:
        """Record this pipeline as the table's writer unless one is; refuse the table if
        another pipeline is. Of two pipelines claiming at once exactly one wins (the
        store's exclusive create)."""
        if self.check_owner(snapshot) is not None:
            return
        body = json.dumps({"pipeline": self.pipeline, "sink": self.sink.name}, sort_keys=True)
        with contextlib.suppress(AlreadyExistsError):
            self.store().create(OWNER, body.encode())
        self.check_owner()

    def visible_batches(self, snapshot: Any) -> dict[int, list[dict[str, Any]]]:
        """This app's batches with files in ``snapshot``: batch → its add actions."""
        out: dict[int, list[dict[str, Any]]] = {}
        app = None if self.pipeline is None else app_tag(self.app_id)
        actions = pa.table(snapshot.get_add_actions(flatten=False))
        cols = [c for c in ("path", "size_bytes", "partition") if c in actions.column_names]
        for row in actions.select(cols).to_pylist():
            # The log holds paths URI-encoded; actions and the store take the object key.
            row["path"] = unquote(row["path"])
            m = _FILE.search(row["path"])
            if m and (app is None or m["app"] == app):
                parts = row.pop("partition", None) or {}
                row["partition_values"] = {c: partition_value(v) for c, v in parts.items()}
                out.setdefault(int(m["batch"]), []).append(row)
        return out

    # Staging -----------------------------------------------------------------------------
    def write_files(
        self, table: pa.Table, batch_id: int, instance: int, attempt: str
    ) -> list[dict[str, Any]]:
        """One Parquet file per partition value (partition columns live in the path and
        the log, not the file); what was written, for the add actions."""
        store, written = self.store(), []
        for n, (values, part) in enumerate(split_partitions(table, self.sink.partition_by)):
            folder = "".join(f"{quote(c, safe='')}={partition_dir(v)}/" for c, v in values)
            path = (
                f"{folder}mb-{app_tag(self.app_id)}-b{batch_id:020d}-i{instance:05d}-"
                f"{n:04d}-{attempt or 'x'}.parquet"
            )
            body = encode_parquet(part)
            try:
                store.put(path, body)
            except Exception as e:
                raise SinkError(f"{self.where}: writing {path} failed: {e}") from e
            written.append(
                {
                    "path": path,
                    "size": len(body),
                    "partition_values": {c: v for c, v in values},
                    "stats": json.dumps(file_stats(part), sort_keys=True),
                    "rows": part.num_rows,
                }
            )
        return written

    # Publishing --------------------------------------------------------------------------
    def publish(
        self,
        batch_id: int,
        files: Sequence[Mapping[str, Any]],
        end_offsets: Mapping[str, int] | None = None,
        supersedes: Sequence[int] = (),
        snapshot: Any = None,
    ) -> bool:
        """Commit batch ``batch_id`` once: its files added, the superseded batches' files
        removed, the app transaction set. False if it was already committed or has nothing
        to show. ``snapshot`` (tests): start from this, possibly stale, snapshot."""
        info = {
            "batch": batch_id,
            "end_offsets": dict(end_offsets or {}),
            "supersedes": sorted(supersedes),
        }
        return self._commit(batch_id, files, supersedes, info, snapshot)

    def publish_rewind(self, batch_id: int, undone: Sequence[int]) -> bool:
        """Record that checkpoint ``batch_id`` undoes ``undone`` (a version with no data):
        their files stay visible until the batches that read their input again replace
        them."""
        return self._commit(batch_id, [], (), {"batch": batch_id, "undoes": sorted(undone)})

    def _commit(
        self,
        batch_id: int,
        files: Sequence[Mapping[str, Any]],
        supersedes: Sequence[int],
        info: Mapping[str, Any],
        snapshot: Any = None,
    ) -> bool:
        if not files and not supersedes and "undoes" not in info:
            return False  # an idle batch: no version, no request, no import (like Kafka's)
        from deltalake import CommitProperties, Transaction
        from deltalake.exceptions import CommitFailedError, DeltaError

        props = CommitProperties(
            custom_metadata={"microbatch": {"app": self.app_id, **info}},
            app_transactions=[Transaction(self.app_id, batch_id)],
        )
        adds = [add_action(f) for f in files]
        last_error: Exception | None = None
        claimed = False
        for attempt in range(MAX_ATTEMPTS):
            dt = snapshot if attempt == 0 and snapshot is not None else self.load()
            if dt is None:
                if not adds:  # no table and nothing to add: nothing to record either
                    return False
                self.create_table()
                continue
            if not claimed:  # before anything of this pipeline is committed
                self.claim(dt)
                claimed = True
            done = dt.transaction_version(self.app_id)
            if done is not None and done >= batch_id:
                log.info("%s: batch %s is already committed (txn %s)", self.where, batch_id, done)
                return False
            change = self.check_schema(dt)
            removes = self._removes(dt, supersedes)
            if not adds and not removes and "undoes" not in info:
                return False  # no rows, and the batches it supersedes showed none either
            if change.add:  # its own metaData commit; then re-read and check again
                try:
                    self._add_columns(dt, change)
                except (CommitFailedError, DeltaError) as e:  # a racing change: re-read
                    last_error = e
                continue
            try:
                dt.create_write_transaction(
                    [*adds, *removes],
                    mode="append",
                    schema=dt.schema(),
                    partition_by=list(self.sink.partition_by) or None,
                    commit_properties=props,
                )
                return True
            except CommitFailedError as e:  # a concurrent commit: re-read, check, retry
                log.info("%s: batch %s conflicted (%s); retrying", self.where, batch_id, e)
                last_error = e
                time.sleep(min(0.05 * 2**attempt, 1.0))
        raise SinkError(
            f"{self.where}: could not commit batch {batch_id} after {MAX_ATTEMPTS} attempts "
            f"(other writers keep committing: {last_error}); rerun the batch to publish it"
        )

    def create_table(self) -> bool:
        """Create the empty table (version 0: protocol and metaData) unless it exists;
        False if another writer created it first.

        delta-rs builds the entry (in a scratch folder, so its protocol versions and
        schema encoding are delta-rs's own) and the store's exclusive create writes it: of
        racing creators exactly one wins. (delta-rs's own create, on finding version 0
        taken, commits its CREATE as version 1 instead, with no conflict check: two
        first batches racing would both be committed.)"""
        from deltalake import DeltaTable

        with tempfile.TemporaryDirectory() as scratch:
            DeltaTable.create(
                scratch, self.sink.schema, partition_by=list(self.sink.partition_by) or None
            )
            lines = Path(scratch, "_delta_log", FIRST_ENTRY).read_text().splitlines()
        actions = [json.loads(line) for line in lines]
        for action in actions:
            if "commitInfo" in action:
                action["commitInfo"].get("operationParameters", {})["location"] = self.uri
                action["commitInfo"]["microbatch"] = {"app": self.app_id, "create": True}
        body = "".join(json.dumps(a, separators=(",", ":")) + "\n" for a in actions)
        try:
            self.store().create(f"_delta_log/{FIRST_ENTRY}", body.encode())
        except AlreadyExistsError:
            return False
        log.info("%s: created the Delta table", self.where)
        return True

    def _add_columns(self, dt: Any, change: SchemaChange) -> None:
        from deltalake import CommitProperties, Field, Schema

        fields = Schema.from_arrow(pa.schema(list(change.add))).fields
        log.info("%s: adding columns %s", self.where, [f.name for f in fields])
        dt.alter.add_columns(
            [Field(f.name, f.type, nullable=True) for f in fields],
            commit_properties=CommitProperties(
                custom_metadata={"microbatch": {"app": self.app_id, "schema": "add columns"}}
            ),
        )

    def _removes(self, dt: Any, supersedes: Sequence[int]) -> list[Any]:
        from deltalake.transaction import RemoveAction

        if not supersedes:
            return []
        now = int(time.time() * 1000)
        visible = self.visible_batches(dt)
        return [
            RemoveAction(
                row["path"],
                data_change=True,
                deletion_timestamp=now,
                size=row["size_bytes"],
                partition_values=row["partition_values"],
            )
            for b in sorted(supersedes)
            for row in visible.get(b, ())
        ]

    def collect_orphans(self, batches: Sequence[int]) -> int:
        """Delete what attempts that lost the commit of (long published) ``batches``
        staged: files of the same app and batch, in its folders (its rows, so partitions,
        are the same in every attempt), with another attempt's id. Only those provably no
        table version ever references: a batch is committed once (its app transaction),
        with the files of one attempt, whose id the snapshot shows. Everything else is
        left to :meth:`vacuum` and its retention: an optimize's merged files (one may be
        about to commit), the files an optimize or a replacement removed (older versions
        still read them), and a batch whose own files the snapshot no longer shows."""
        wanted = set(batches)
        dt = self.load() if wanted else None
        if dt is None:
            return 0
        deleted, store = 0, self.store()
        for b, files in self.visible_batches(dt).items():
            if b not in wanted:
                continue
            by_app: dict[str, list[str]] = {}
            for f in files:
                by_app.setdefault(_app_of(f["path"]), []).append(f["path"])
            for paths in by_app.values():
                winner = {staging_attempt(p) for p in paths} - {None}
                if not winner:
                    continue  # compacted: which attempt won is in no file it shows
                for folder, prefix in {_batch_prefix(p) for p in paths}:
                    for key in store.list(folder + prefix):
                        attempt = staging_attempt(key)
                        if attempt is not None and attempt not in winner:
                            store.delete(key)
                            deleted += 1
        return deleted

    # Maintenance ---------------------------------------------------------------------------
    def optimize(
        self, dry_run: bool = False, before_commit: Callable[[], None] | None = None
    ) -> dict[str, Any]:
        """Compact this app's files: per batch and partition, its instances' files become
        one, in a commit of ``dataChange: false`` removes and adds (streaming readers skip
        it; no rows change). Files never merge across batches: each keeps its batch's name,
        so a later backfill still finds and replaces the batch, and no ``txn`` changes.

        ``before_commit`` runs after the merged files are written, right before the commit
        (``microbatch optimize`` checks the pipeline's lease there, so an optimize that
        stalled past it commits nothing); if it raises, the merged files are deleted and
        nothing is committed. Inputs replaced meanwhile make the commit conflict (Delta's
        check of concurrent removes): it plans again."""
        from deltalake import CommitProperties
        from deltalake.exceptions import CommitFailedError

        from microbatch.runtime.faults import pause_if  # the kill-and-race tests' hook

        last_error: Exception | None = None
        for attempt in range(MAX_ATTEMPTS):
            dt = self.load()
            groups: dict[tuple[int, str], list[dict[str, Any]]] = {}
            for b, files in ({} if dt is None else self.visible_batches(dt)).items():
                for f in files:
                    groups.setdefault((b, f["path"].rpartition("/")[0]), []).append(f)
            groups = {k: sorted(fs, key=lambda f: f["path"]) for k, fs in groups.items()
                      if len(fs) > 1}  # fmt: skip
            summary = {
                "table": self.sink.table_uri,
                "batches": len({b for b, _ in groups}),
                "files_before": sum(len(fs) for fs in groups.values()),
                "files_after": len(groups),
                "version": None,
            }
            if dt is None or dry_run or not groups:
                return summary
            token = uuid.uuid4().hex[:8]
            merged, actions = [], []
            for fs in groups.values():
                path, changes = self._compact(dt.version(), fs, token)
                merged.append(path)
                actions.extend(changes)
            counts = {k: summary[k] for k in ("batches", "files_before", "files_after")}
            info = {"app": self.app_id, "optimize": counts}
            try:
                pause_if("in_delta_optimize", f"{self.where} optimize")
                if before_commit is not None:
                    before_commit()
            except Exception:
                self._discard(merged)
                raise
            try:
                dt.create_write_transaction(
                    actions,
                    mode="append",
                    schema=dt.schema(),
                    partition_by=list(self.sink.partition_by) or None,
                    commit_properties=CommitProperties(custom_metadata={"microbatch": info}),
                )
            except CommitFailedError as e:  # a batch replaced meanwhile: plan again
                self._discard(merged)
                last_error = e
                time.sleep(min(0.05 * 2**attempt, 1.0))
                continue
            summary["version"] = self.load().version()
            return summary
        raise SinkError(f"{self.where}: optimize kept conflicting ({last_error}); run it again")

    def _discard(self, paths: Iterable[str]) -> None:
        """Delete merged files no commit took (their names are this optimize's own)."""
        store = self.store()
        for path in paths:
            with contextlib.suppress(ObjectNotFoundError):
                store.delete(path)

    def _compact(
        self, version: int, files: Sequence[Mapping[str, Any]], token: str
    ) -> tuple[str, list[Any]]:
        """The merged file written for ``files`` (one batch, one partition; named after the
        batch, the version planned on and ``token``, this optimize's) and the actions
        replacing them by it."""
        import io

        import pyarrow.parquet as pq
        from deltalake.transaction import AddAction, RemoveAction

        store, now = self.store(), int(time.time() * 1000)
        merged = pa.concat_tables(
            [pq.read_table(io.BytesIO(store.get(f["path"]))) for f in files],
            promote_options="default",
        )
        m = _FILE.search(files[0]["path"])
        assert m is not None  # visible_batches matched it
        folder, _, _ = files[0]["path"].rpartition("/")
        name = (
            f"mb-{m['app']}-b{m['batch']}-i{m['instance']}-0000-merged-v{version}_{token}.parquet"
        )
        path = f"{folder}/{name}" if folder else name
        body = encode_parquet(merged)
        store.put(path, body)
        parts = dict(files[0]["partition_values"])
        stats = json.dumps(file_stats(merged), sort_keys=True)
        add = AddAction(path, len(body), parts, now, False, stats)
        removes = [
            RemoveAction(
                f["path"],
                data_change=False,
                deletion_timestamp=now,
                size=f["size_bytes"],
                partition_values=parts,
            )
            for f in files
        ]
        return path, [add, *removes]

    def vacuum(self, retention_hours: float = 168, dry_run: bool = False) -> list[str]:
        """Delete files no version newer than ``retention_hours`` references: replaced
        batches' files (time travel to them ends) and files of attempts whose checkpoint
        never committed. Run it holding the pipeline's lease, after publishing any
        committed batch (``microbatch optimize --vacuum`` does): then no file a checkpoint
        still has to publish is unreferenced. At least 1 hour, so files another writer is
        about to commit survive."""
        if retention_hours < 1:
            raise ConfigError(
                f"{self.where}: vacuum retention {retention_hours} h is below 1 h: files "
                "another writer staged but has not committed yet would be deleted"
            )
        dt = self.load()
        if dt is None:
            return []
        return sorted(
            dt.vacuum(
                retention_hours=int(retention_hours),
                dry_run=dry_run,
                enforce_retention_duration=False,
                full=True,
            )
        )

    def awaiting_replacement(self, undone: Iterable[int] = ()) -> Awaiting:
        """Undone batches (recorded by rewinds, plus ``undone``) whose files are visible,
        with the end offsets their commits recorded (read from the history: rewinds only).

        Without a pipeline (a table written before owners were recorded), the one pipeline
        whose commits of this sink the history holds is the one rewinding; two are refused:
        whose batches were undone could not be told apart."""
        dt = self.load()
        if dt is None:
            return {}
        if self.pipeline is None:
            writers = sorted(pipelines_in_history(dt, self.sink.name))
            if len(writers) > 1:
                raise ConfigError(
                    f"{self.where}: pipelines {writers[0]!r} and {writers[1]!r} both write "
                    "the table, so a rewind cannot tell whose batches it undoes. Give "
                    "each pipeline's sink a Delta table of its own."
                )
            if not writers:
                return {}
            return DeltaTarget(self.sink, writers[0], self.settings).awaiting_replacement(undone)
        undoes, ends = set(undone), {}
        for commit in dt.history():
            info = commit.get("microbatch")
            if not isinstance(info, dict) or info.get("app") != self.app_id:
                continue
            undoes.update(info.get("undoes", ()))
            if "end_offsets" in info:
                ends[int(info["batch"])] = info["end_offsets"]
        visible = set(self.visible_batches(dt))
        out: Awaiting = {}
        for b in sorted(undoes & visible):
            if b not in ends:
                raise SinkError(
                    f"{self.where}: batch {b} is visible but its commit is no longer in the "
                    "Delta log (delta.logRetentionDuration expired it), so what it read is "
                    "unknown and it cannot be replaced; raise the table's "
                    "delta.logRetentionDuration above the oldest interval you backfill"
                )
            out[str(b)] = ends[b]
        return out


# Helpers -------------------------------------------------------------------------------
def pipelines_in_history(snapshot: Any, sink_name: str | None = None) -> set[str]:
    """The pipelines whose commits (of ``sink_name``, or any sink) the table's log holds."""
    out = set()
    for commit in snapshot.history():
        info = commit.get("microbatch")
        app = str(info.get("app", "")) if isinstance(info, dict) else ""
        pipeline, _, sink = app.rpartition("/")
        if pipeline and sink_name in (None, sink):
            out.add(pipeline)
    return out


def staging_attempt(path: str) -> str | None:
    """The attempt that staged the data file at ``path``; None for an optimize's merged
    file (of any version of this module) and for anything else."""
    m = _FILE.search(path)
    if m is None or m["attempt"] is None or _OLD_MERGED.fullmatch(m["attempt"]):
        return None
    return m["attempt"]


def _app_of(path: str) -> str:
    m = _FILE.search(path)
    assert m is not None  # visible_batches matched it
    return m["app"]


def _batch_prefix(path: str) -> tuple[str, str]:
    """(folder, ``mb-<app>-b<batch>-``) of a data file: where its batch's attempts write."""
    folder, _, name = path.rpartition("/")
    return (folder + "/" if folder else ""), name[: name.index("-i")] + "-"


def app_tag(app_id: str) -> str:
    """8 hex digits naming an app in file names (pipeline and sink names may hold '-')."""
    return hashlib.sha256(app_id.encode()).hexdigest()[:8]


def table_location(uri: str) -> str:
    """What delta-rs opens: ``s3://`` as is, ``file://`` and plain paths as absolute paths."""
    import os

    parsed = urlparse(uri)
    if parsed.scheme == "s3":
        return uri.rstrip("/")
    if parsed.scheme == "file":
        return unquote(parsed.path)
    return os.path.abspath(uri)


def storage_options(uri: str, settings: Settings) -> dict[str, str] | None:
    """delta-rs S3 options from the settings (None for local tables). Commit files are
    created with ``If-None-Match: *``, which SeaweedFS, MinIO and AWS S3 honour."""
    if urlparse(uri).scheme != "s3":
        return None
    opts = {"AWS_REGION": settings.s3_region}
    if settings.s3_access_key_id:  # else the AWS default chain, as for boto3
        opts["AWS_ACCESS_KEY_ID"] = settings.s3_access_key_id
        opts["AWS_SECRET_ACCESS_KEY"] = settings.s3_secret_access_key
    if settings.s3_endpoint_url:
        opts["AWS_ENDPOINT_URL"] = settings.s3_endpoint_url
        opts["AWS_ALLOW_HTTP"] = str(settings.s3_endpoint_url.startswith("http://")).lower()
    return opts


def split_partitions(
    table: pa.Table, partition_by: Sequence[str]
) -> list[tuple[list[tuple[str, str | None]], pa.Table]]:
    """(partition values as Delta strings, the rows without partition columns), one per
    distinct value, in a fixed order (so reruns name and fill the same files)."""
    if not partition_by:
        return [([], table)]
    keys = table.select(list(partition_by)).to_pylist()
    groups: dict[tuple[str | None, ...], list[int]] = {}
    for i, row in enumerate(keys):
        groups.setdefault(tuple(partition_value(row[c]) for c in partition_by), []).append(i)
    rest = table.drop_columns(list(partition_by))
    order = sorted(groups, key=lambda vs: [(v is None, v or "") for v in vs])
    return [(list(zip(partition_by, vs, strict=True)), rest.take(groups[vs])) for vs in order]


def partition_value(value: Any) -> str | None:
    """A partition value as the Delta log writes it (a string; None for null)."""
    if value is None:
        return None
    if isinstance(value, bool):
        return "true" if value else "false"
    if hasattr(value, "isoformat"):
        return value.isoformat()
    return str(value)


def partition_dir(value: str | None) -> str:
    return _NULL_PARTITION if value is None else quote(value, safe="")


def file_stats(table: pa.Table) -> dict[str, Any]:
    """Delta file statistics (numRecords; min, max and null counts of integer and short
    string columns) so readers can skip files."""
    mins, maxs, nulls = {}, {}, {}
    for name, col in zip(table.column_names, table.columns, strict=True):
        t = col.type
        if not (pa.types.is_integer(t) or pa.types.is_string(t)):
            continue
        nulls[name] = col.null_count
        if col.null_count == len(col):
            continue
        lo, hi = (v.as_py() for v in pc.min_max(col).values())
        if isinstance(lo, str) and (len(lo) > 32 or len(hi) > 32):
            continue  # readers truncate long strings; better no bound than a wrong one
        mins[name], maxs[name] = lo, hi
    return {"numRecords": table.num_rows, "minValues": mins, "maxValues": maxs,
            "nullCount": nulls}  # fmt: skip


def add_action(file: Mapping[str, Any]) -> Any:
    from deltalake.transaction import AddAction

    return AddAction(
        path=file["path"],
        size=int(file["size"]),
        partition_values=dict(file["partition_values"]),
        modification_time=int(time.time() * 1000),
        data_change=True,
        stats=file["stats"],
    )


def staged_files(store: ObjectStore, key: str) -> list[dict[str, Any]]:
    """The files one instance staged (its index in the checkpoint store)."""
    return list(json.loads(store.get(key))["files"])


def read_delta_sink(uri: str, settings: Settings | None = None) -> pa.Table:
    """The table's current rows (delta-rs), for tests and tools."""
    from deltalake import DeltaTable

    settings = settings or Settings.from_env()
    dt = DeltaTable(table_location(uri), storage_options=storage_options(uri, settings))
    return pa.table(dt.to_pyarrow_table())
