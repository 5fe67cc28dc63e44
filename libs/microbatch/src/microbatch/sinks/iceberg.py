"""Exactly-once Apache Iceberg output: Parquet files staged per instance, one snapshot per
batch whose summary names the app (``<pipeline>/<sink>``) and the batch (docs/iceberg.md).

**Stage** (stage-2 tasks, before the checkpoint commits): the table is loaded (created empty
if missing; new nullable columns added: metadata-only commits), and the instance's rows are
written as Parquet files carrying the table's field ids, one per partition value, named
after app, batch, instance and attempt; an index of them goes to the checkpoint store.

**Publish** (the driver, after the commit): ONE snapshot adding the batch's files and
removing those of the undone batches it supersedes. The current snapshot's ancestry is
walked first: a batch already committed (a rerun, a zombie) commits nothing. The commit is
a compare-and-swap on the catalog's pointer; a loser reloads and checks again (pyiceberg's
own retry, which would skip that check, is off for these commits).

Not here yet: compaction and snapshot expiry.
"""

from __future__ import annotations

import base64
import dataclasses
import importlib.util
import io
import json
import logging
import re
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import pyarrow as pa

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
from microbatch.sinks.delta import app_tag
from microbatch.sinks.iceberg_catalog import IcebergCatalog
from microbatch.sinks.parquet import encode_parquet
from microbatch.storage import open_store
from microbatch.validation import check_name

log = logging.getLogger(__name__)

__all__ = ["IcebergCatalog", "IcebergSink", "IcebergTarget", "read_iceberg_sink"]

#: Commits reloaded and retried after another writer moved the table before giving up.
MAX_ATTEMPTS = 8
APP, BATCH, END_OFFSETS = "microbatch.app", "microbatch.batch", "microbatch.end-offsets"
SUPERSEDES, UNDOES = "microbatch.supersedes", "microbatch.undoes"
_FILE = re.compile(
    r"(?:^|/)mb-(?P<app>[0-9a-f]{8})-b(?P<batch>\d{20})-i(?P<instance>\d{5})-\d{4}-\w+\.parquet$"
)


@dataclasses.dataclass(frozen=True)
class IcebergSink(Sink):
    """An Iceberg table ``table`` (``namespace.name``) in ``catalog``, one snapshot per
    batch, exactly once.

    ``schema`` (a ``pyarrow.Schema``) is the table's, created from it if missing;
    ``partition_by`` names string, integer, boolean or date columns (identity partitions).
    ``catalog`` is an :class:`IcebergCatalog` (or its properties as a dict); None means
    :meth:`IcebergCatalog.embedded`. Read with any Iceberg reader.
    """

    name: str
    table: str
    schema: Any
    catalog: Any = None
    partition_by: tuple[str, ...] = ()

    retractable = True

    def __post_init__(self) -> None:
        check_name("sink", self.name)
        if not isinstance(self.table, str) or len(self.table.split(".")) < 2:
            raise ConfigError(
                f"sink {self.name!r}: table {self.table!r} must be 'namespace.name' (an Iceberg "
                "table identifier)"
            )
        if importlib.util.find_spec("pyiceberg") is None:
            raise ConfigError(
                f"sink {self.name!r}: the Iceberg sink needs the pyiceberg package "
                "(pip install 'pyiceberg[sql-sqlite,pyarrow]==0.12.0'; `make venv` installs it)"
            )
        if not isinstance(self.schema, pa.Schema):
            raise ConfigError(
                f"sink {self.name!r}: schema must be a pyarrow.Schema (the Iceberg table's "
                f"columns), got {type(self.schema).__name__}"
            )
        if isinstance(self.catalog, Mapping):
            object.__setattr__(self, "catalog", IcebergCatalog(properties=self.catalog))  # type: ignore[arg-type]
        elif self.catalog is not None and not isinstance(self.catalog, IcebergCatalog):
            raise ConfigError(
                f"sink {self.name!r}: catalog must be an IcebergCatalog or a dict of pyiceberg "
                f"catalog properties, got {type(self.catalog).__name__}"
            )
        columns = partition_columns(self.name, self.schema, self.partition_by)
        object.__setattr__(self, "partition_by", columns)

    def catalog_for(self, settings: Settings) -> IcebergCatalog:
        return self.catalog if self.catalog is not None else IcebergCatalog.embedded(settings)

    def target(self, settings: Settings | None, pipeline: str | None) -> IcebergTarget:
        return IcebergTarget(self, pipeline, settings)

    def stage(self, ctx: StageContext, rows: Sequence[Any]) -> Staged | None:
        table = rows_to_table(self.name, rows, self.schema)
        if table.num_rows == 0:
            return None
        files = self.target(ctx.settings, ctx.pipeline).write_files(
            table, ctx.batch_id, ctx.instance, ctx.attempt
        )
        key = (
            f"{ctx.layout.staging_dir(ctx.batch_id)}{self.name}/"
            f"part-{ctx.instance:05d}-{ctx.attempt}.json"
        )
        ctx.checkpoint_store.put(key, json.dumps({"files": files}, sort_keys=True).encode())
        return Staged(key, table.num_rows)

    def publish(self, ctx: PublishContext) -> None:
        files = [
            f for s in ctx.staged for f in json.loads(ctx.checkpoint_store.get(s.file))["files"]
        ]
        self.target(ctx.settings, ctx.pipeline).publish(
            ctx.batch_id, files, ctx.end_offsets, ctx.supersedes
        )

    def publish_rewind(self, ctx: PublishContext, undone: Sequence[int]) -> None:
        self.target(ctx.settings, ctx.pipeline).publish_rewind(ctx.batch_id, undone)

    def awaiting_replacement(self, settings: Settings, undone: Sequence[int]) -> Awaiting:
        # As for Delta: the hook does not get the pipeline, so any app of this sink matches.
        return self.target(settings, None).awaiting_replacement(undone)

    def collect_orphans(self, settings: Settings, batches: Sequence[int]) -> int:
        return self.target(settings, None).collect_orphans(batches)

    def shared_storage_url(self) -> str | None:
        return None if self.catalog is None else self.catalog.get("warehouse")

    def dataset(self, settings: Settings) -> DatasetRef:
        """The table's location (OpenLineage names a table by where its files are)."""
        table = self.target(settings, None).load()
        if table is not None:
            return url_dataset(table.location())
        warehouse = self.catalog_for(settings).get("warehouse")
        if warehouse:  # where a SQL catalog will put it
            return url_dataset(f"{warehouse.rstrip('/')}/{self.table.replace('.', '/')}")
        return DatasetRef("iceberg", self.table)

    def last_published(self, settings: Settings, pipeline: str) -> int | None:
        target = self.target(settings, pipeline)
        table = target.load()
        return None if table is None else target.committed_batch(table)


class IcebergTarget:
    """The sink's table as one pipeline (or, with ``pipeline=None``, any) sees it."""

    def __init__(self, sink: IcebergSink, pipeline: str | None, settings: Settings | None) -> None:
        self.sink = sink
        self.pipeline = pipeline
        self.settings = settings or Settings.from_env()
        self.app_id = f"{pipeline}/{sink.name}"
        owner = f"pipeline {pipeline!r} " if pipeline is not None else ""
        self.where = f"{owner}sink {sink.name!r} (Iceberg table {sink.table})"

    # Reading -----------------------------------------------------------------------------
    def open_catalog(self) -> Any:
        return self.sink.catalog_for(self.settings).open(self.settings)

    def load(self) -> Any:
        """The table as the catalog has it now, or None if there is none yet."""
        from pyiceberg.exceptions import NoSuchTableError

        try:
            return self.open_catalog().load_table(self.sink.table)
        except NoSuchTableError:
            return None

    def committed_batch(self, table: Any) -> int | None:
        """The newest batch this app committed: its newest snapshot in the current lineage."""
        for summary in self._lineage(table):
            if summary.get(APP) == self.app_id and summary.get(BATCH) is not None:
                return int(summary[BATCH])
        return None

    def _lineage(self, table: Any) -> Iterable[Mapping[str, Any]]:
        """The summaries of the current snapshot and its ancestors, newest first."""
        from pyiceberg.table.snapshots import ancestors_of

        for snapshot in ancestors_of(table.current_snapshot(), table.metadata):
            yield snapshot.summary.additional_properties if snapshot.summary else {}

    def visible_batches(self, table: Any) -> dict[int, list[Any]]:
        """This app's (any app's, without a pipeline) batches with files in the current
        snapshot: batch → its ``DataFile``s, found by their names."""
        snapshot = table.current_snapshot()
        if snapshot is None:
            return {}
        app = None if self.pipeline is None else app_tag(self.app_id)
        out: dict[int, list[Any]] = {}
        for manifest in snapshot.manifests(table.io):
            for entry in manifest.fetch_manifest_entry(table.io, discard_deleted=True):
                m = _FILE.search(entry.data_file.file_path)
                if m and (app is None or m["app"] == app):
                    out.setdefault(int(m["batch"]), []).append(entry.data_file)
        return out

    # Schema -------------------------------------------------------------------------------
    def check_schema(self, table: Any) -> list[pa.Field]:
        """The nullable columns the sink adds, or a :class:`SinkError` naming the column."""
        mine = self.sink_schema()
        theirs = table.schema()
        spec_columns = [theirs.find_field(f.source_id).name for f in table.spec().fields]
        if spec_columns != list(self.sink.partition_by):
            raise SinkError(
                f"{self.where}: the table is partitioned by {spec_columns} but the sink says "
                f"partition_by={list(self.sink.partition_by)}; make them equal (or evolve the "
                "table's partition spec first)"
            )
        names = {f.name for f in mine.fields}
        for field in theirs.fields:
            if field.name not in names:
                if field.required:
                    raise SinkError(
                        f"{self.where}: column {field.name!r} is required in the table but "
                        "missing from the sink's schema; add it back to the schema (or make "
                        "the column optional in the table first)"
                    )
                continue
            new = mine.find_field(field.name)
            if _arrow_type(new.field_type) != _arrow_type(field.field_type):
                raise SinkError(
                    f"{self.where}: column {field.name!r} has type {field.field_type} in the "
                    f"table but {new.field_type} in the sink's schema; keep the table's type, or "
                    "write a new column or table"
                )
            if field.required and not new.required:
                raise SinkError(
                    f"{self.where}: column {field.name!r} is required in the table but nullable "
                    "in the sink's schema; declare it pa.field(..., nullable=False)"
                )
        known = {f.name for f in theirs.fields}
        added = []
        for field in mine.fields:
            if field.name in known:
                continue
            if field.required:
                raise SinkError(
                    f"{self.where}: new column {field.name!r} is NOT NULL, but the table's "
                    "existing rows have no value for it; declare it nullable to add it"
                )
            added.append(self.sink.schema.field(field.name))
        return added

    def sink_schema(self) -> Any:
        """The sink's Arrow schema as an Iceberg schema (fresh field ids)."""
        from pyiceberg.catalog import Catalog
        from pyiceberg.schema import assign_fresh_schema_ids

        try:  # the conversion pyiceberg's create_table applies to a pyarrow schema
            return assign_fresh_schema_ids(Catalog._convert_schema_if_needed(self.sink.schema))
        except Exception as e:
            raise SinkError(
                f"{self.where}: the schema has no Iceberg equivalent ({e}); use types Iceberg "
                "has (string, int32/int64, float32/64, boolean, date, timestamp[us], decimal, "
                "binary, lists, structs, maps)"
            ) from e

    def ready_table(self) -> Any:
        """The table, created if missing and with the sink's new nullable columns added
        (metadata-only commits: readers see no rows), checked against the sink's schema."""
        from pyiceberg.exceptions import CommitFailedException, TableAlreadyExistsError

        last_error: Exception | None = None
        for _ in range(MAX_ATTEMPTS):
            table = self.load()
            try:
                if table is None:
                    self._create()
                    continue
                added = self.check_schema(table)
                if not added:
                    return table
                log.info("%s: adding columns %s", self.where, [f.name for f in added])
                with table.update_schema() as update:
                    update.union_by_name(pa.schema(added))
            except (CommitFailedException, TableAlreadyExistsError) as e:  # a racing writer
                last_error = e
        raise SinkError(f"{self.where}: could not create or evolve the table ({last_error})")

    def _create(self) -> None:
        catalog = self.open_catalog()
        namespace = self.sink.table.rsplit(".", 1)[0]
        catalog.create_namespace_if_not_exists(namespace)
        tx = catalog.create_table_transaction(self.sink.table, schema=self.sink_schema())
        if self.sink.partition_by:
            with tx.update_spec() as spec:
                for col in self.sink.partition_by:
                    spec.add_identity(col)
        tx.commit_transaction()
        log.info("%s: created the Iceberg table", self.where)

    # Staging -----------------------------------------------------------------------------
    def write_files(
        self, rows: pa.Table, batch_id: int, instance: int, attempt: str
    ) -> list[dict[str, Any]]:
        """One Parquet file per partition value, with the table's field ids; what publish
        needs to name them in a snapshot (path, size, partition, statistics)."""
        import pyarrow.parquet as pq
        from pyiceberg.io.pyarrow import (
            compute_statistics_plan,
            data_file_statistics_from_parquet_metadata,
            parquet_path_to_id_mapping,
            schema_to_pyarrow,
        )
        from pyiceberg.partitioning import partition_record_value
        from pyiceberg.typedef import Record

        table = self.ready_table()
        schema, spec = table.schema(), table.spec()
        file_schema = schema_to_pyarrow(schema.select(*rows.column_names))
        rows = pa.Table.from_arrays(
            [rows.column(f.name).cast(f.type) for f in file_schema], schema=file_schema
        )
        root = _data_root(table)
        store, written = open_store(root, self.settings), []
        plan = compute_statistics_plan(schema, table.properties)
        ids = parquet_path_to_id_mapping(schema)
        for n, (values, part) in enumerate(_split(rows, self.sink.partition_by)):
            record = [
                partition_record_value(f, v, schema)
                for f, v in zip(spec.fields, values, strict=True)
            ]
            folder = spec.partition_to_path(Record(*record), schema) + "/" if record else ""
            key = (
                f"{folder}mb-{app_tag(self.app_id)}-b{batch_id:020d}-i{instance:05d}-"
                f"{n:04d}-{attempt or 'x'}.parquet"
            )
            body = encode_parquet(part)
            try:
                store.put(key, body)
            except Exception as e:
                raise SinkError(f"{self.where}: writing {root}{key} failed: {e}") from e
            stats = data_file_statistics_from_parquet_metadata(
                pq.read_metadata(io.BytesIO(body)), plan, ids
            ).to_serialized_dict()
            written.append(
                {
                    "path": root + key,
                    "size": len(body),
                    "spec_id": spec.spec_id,
                    "partition": record,
                    "field_ids": {f.name: _field_id(f) for f in file_schema},
                    "stats": _stats_to_json(stats),
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
        table: Any = None,
    ) -> bool:
        """Commit batch ``batch_id`` once (its files added, the superseded batches' files
        removed); False if it was already committed or has nothing to show. ``table``
        (tests): start from this, possibly stale, table."""
        summary = {
            END_OFFSETS: json.dumps(dict(end_offsets or {}), sort_keys=True),
            SUPERSEDES: json.dumps(sorted(supersedes)),
        }
        return self._commit(batch_id, files, supersedes, summary, table)

    def publish_rewind(self, batch_id: int, undone: Sequence[int]) -> bool:
        """Record that checkpoint ``batch_id`` undoes ``undone`` (a snapshot with no data
        change): their rows stay visible until the batches that read their input again
        replace them."""
        return self._commit(batch_id, [], (), {UNDOES: json.dumps(sorted(undone))})

    def _commit(
        self,
        batch_id: int,
        files: Sequence[Mapping[str, Any]],
        supersedes: Sequence[int],
        summary: Mapping[str, str],
        table: Any = None,
    ) -> bool:
        if not files and not supersedes and UNDOES not in summary:
            return False  # an idle batch: no snapshot (like the Delta sink's)
        from pyiceberg.exceptions import CommitFailedException

        props = {APP: self.app_id, BATCH: str(batch_id), **summary}
        last_error: Exception | None = None
        for attempt in range(MAX_ATTEMPTS):
            if attempt or table is None:
                table = self.ready_table() if files else self.load()
            if table is None:
                return False  # no table and nothing to add: nothing to record either
            done = self.committed_batch(table)
            if done is not None and done >= batch_id:
                log.info("%s: batch %s is already committed (at %s)", self.where, batch_id, done)
                return False
            self.check_schema(table)
            adds = [self._data_file(table, f) for f in files]
            visible = self.visible_batches(table)
            removes = [f for b in sorted(set(supersedes)) for f in visible.get(b, ())]
            if not adds and not removes and UNDOES not in summary:
                return False  # no rows, and the batches it supersedes showed none either
            try:
                self._commit_snapshot(table, adds, removes, props)
                return True
            except CommitFailedException as e:  # another writer moved the table: reload
                log.info("%s: batch %s conflicted (%s); retrying", self.where, batch_id, e)
                last_error = e
                time.sleep(min(0.05 * 2**attempt, 1.0))
        raise SinkError(
            f"{self.where}: could not commit batch {batch_id} after {MAX_ATTEMPTS} attempts "
            f"(other writers keep committing: {last_error}); rerun the batch to publish it"
        )

    def _commit_snapshot(
        self, table: Any, adds: Sequence[Any], removes: Sequence[Any], props: dict[str, str]
    ) -> None:
        """One snapshot, or CommitFailedException if the table moved since ``table``."""
        from pyiceberg.table import Table, TableProperties

        # pyiceberg would retry a failed commit on the new head by itself, without our
        # already-committed check: a zombie's batch would land twice. A copy of the loaded
        # table with its retries at 0 makes the failure ours to handle (nothing is stored).
        no_retry = {**table.metadata.properties, TableProperties.COMMIT_NUM_RETRIES: "0"}
        table = Table(
            table.name(),
            table.metadata.model_copy(update={"properties": no_retry}),
            table.metadata_location,
            table.io,
            table.catalog,
        )
        tx = table.transaction()
        update = tx.update_snapshot(snapshot_properties=props)
        with update.overwrite() if removes else update.fast_append() as snapshot:
            for data_file in adds:
                snapshot.append_data_file(data_file)
            for data_file in removes:
                snapshot.delete_data_file(data_file)
        tx.commit_transaction()

    def _data_file(self, table: Any, file: Mapping[str, Any]) -> Any:
        from pyiceberg.manifest import DataFile, DataFileContent, FileFormat
        from pyiceberg.typedef import Record

        schema = table.schema()
        for name, field_id in file["field_ids"].items():
            current = schema.find_column_name(int(field_id))
            if current != name:
                raise SinkError(
                    f"{self.where}: staged file {file['path']} holds column {name!r} as field "
                    f"id {field_id}, which the table now calls {current!r} (the column was "
                    "dropped or renamed since the batch was staged); restore the column, or "
                    "rewind the pipeline to before this batch and run it again"
                )
        return DataFile.from_args(
            content=DataFileContent.DATA,
            file_path=file["path"],
            file_format=FileFormat.PARQUET,
            partition=Record(*file["partition"]),
            file_size_in_bytes=int(file["size"]),
            sort_order_id=None,
            spec_id=int(file["spec_id"]),
            equality_ids=None,
            key_metadata=None,
            **_stats_from_json(file["stats"]),
        )

    # Replacement and GC ---------------------------------------------------------------------
    def awaiting_replacement(self, undone: Iterable[int] = ()) -> Awaiting:
        """Undone batches (recorded by rewinds, plus ``undone``) whose files are visible,
        with the end offsets their snapshots recorded."""
        table = self.load()
        if table is None:
            return {}
        undoes, ends = set(undone), {}
        for summary in self._lineage(table):
            if not self._mine(summary):
                continue
            undoes.update(json.loads(summary.get(UNDOES, "[]")))
            if END_OFFSETS in summary:
                ends.setdefault(int(summary[BATCH]), json.loads(summary[END_OFFSETS]))
        out: Awaiting = {}
        for b in sorted(undoes & set(self.visible_batches(table))):
            if b not in ends:
                raise SinkError(
                    f"{self.where}: batch {b} is visible but its snapshot was expired, so what "
                    "it read is unknown and it cannot be replaced; keep snapshots longer than "
                    "the oldest interval you backfill (history.expire.max-snapshot-age-ms)"
                )
            out[str(b)] = ends[b]
        return out

    def _mine(self, summary: Mapping[str, Any]) -> bool:
        app = str(summary.get(APP, ""))
        if self.pipeline is None:
            return app.endswith(f"/{self.sink.name}")
        return app == self.app_id

    def collect_orphans(self, batches: Sequence[int]) -> int:
        """Delete the files of (long published) ``batches`` that attempts which lost the
        commit left next to the committed ones (same batch and folder, another attempt).
        A file any live snapshot references is never deleted, whatever its name."""
        wanted = set(batches)
        table = self.load() if wanted else None
        if table is None:
            return 0
        referenced = self.referenced_files(table)
        root = _data_root(table)
        prefixes = {
            _batch_prefix(f.file_path[len(root) :])
            for b, files in self.visible_batches(table).items()
            if b in wanted
            for f in files
            if f.file_path.startswith(root)
        }
        store, deleted = open_store(root, self.settings), 0
        for prefix in sorted(prefixes):
            for key in store.list(prefix):
                if root + key not in referenced and _FILE.search(key):
                    store.delete(key)
                    deleted += 1
        return deleted

    def referenced_files(self, table: Any) -> set[str]:
        """Every data file path a live snapshot of the table names (any writer's)."""
        manifests = {m.manifest_path: m for s in table.snapshots() for m in s.manifests(table.io)}
        return {
            entry.data_file.file_path
            for m in manifests.values()
            for entry in m.fetch_manifest_entry(table.io, discard_deleted=False)
        }


# Helpers -------------------------------------------------------------------------------
def _data_root(table: Any) -> str:
    """Where the table's data files go, with a trailing '/'."""
    root = table.properties.get("write.data.path") or f"{table.location().rstrip('/')}/data"
    return root.rstrip("/") + "/"


def _field_id(field: pa.Field) -> str:
    return field.metadata[b"PARQUET:field_id"].decode()


def _batch_prefix(key: str) -> str:
    """``<folder>/mb-<app>-b<batch>-`` of a data file: where its batch's attempts write."""
    folder, _, name = key.rpartition("/")
    return (folder + "/" if folder else "") + name[: name.index("-i")] + "-"


def _arrow_type(iceberg_type: Any) -> pa.DataType:
    """An Iceberg type as Arrow sees it, so types compare without their field ids."""
    from pyiceberg.io.pyarrow import schema_to_pyarrow

    return schema_to_pyarrow(iceberg_type, include_field_ids=False)


def _split(rows: pa.Table, columns: Sequence[str]) -> list[tuple[tuple[Any, ...], pa.Table]]:
    """(partition values, its rows), one per distinct value, in a fixed order (so reruns
    name and fill the same files). Iceberg keeps partition columns in the files too."""
    if not columns:
        return [((), rows)]
    groups: dict[tuple[Any, ...], list[int]] = {}
    for i, row in enumerate(rows.select(list(columns)).to_pylist()):
        groups.setdefault(tuple(row[c] for c in columns), []).append(i)
    order = sorted(groups, key=lambda vs: [(v is None, str(v)) for v in vs])
    return [(vs, rows.take(pa.array(groups[vs], pa.int64()))) for vs in order]


def _stats_to_json(stats: Mapping[str, Any]) -> dict[str, Any]:
    """pyiceberg's data-file statistics as JSON: int keys as strings, bounds in base64."""
    as_json = lambda v: base64.b64encode(v).decode() if isinstance(v, bytes) else v  # noqa: E731
    return {key: {str(k): as_json(v) for k, v in value.items()} if isinstance(value, dict)
            else value for key, value in stats.items()}  # fmt: skip


def _stats_from_json(stats: Mapping[str, Any]) -> dict[str, Any]:
    bounds = ("lower_bounds", "upper_bounds")
    return {key: {int(k): base64.b64decode(v) if key in bounds else v for k, v in value.items()}
            if isinstance(value, dict) else value for key, value in stats.items()}  # fmt: skip


def read_iceberg_sink(sink: IcebergSink, settings: Settings | None = None) -> pa.Table:
    """The table's current rows (pyiceberg's scan), for tests and tools."""
    table = sink.target(settings, None).load()
    if table is None:
        return pa.table({f.name: pa.array([], f.type) for f in sink.schema})
    return table.scan().to_arrow()
