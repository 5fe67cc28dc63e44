"""The Iceberg sink's table as one pipeline writes it: staged files, one snapshot per batch,
replacement of undone batches, the GC of losing attempts, and maintenance.

**Stage** (stage-2 tasks, before the checkpoint commits): the table is loaded (created empty
if missing; new nullable columns added: metadata-only commits), and the instance's rows are
written as Parquet files carrying the table's field ids, one per partition value, named
after app, batch, instance and attempt (:mod:`~microbatch.sinks.iceberg_files`).

**Publish** (the driver, after the commit): ONE snapshot adding the batch's files and
removing those of the undone batches it supersedes. The current snapshot's ancestry is
walked first (:mod:`~microbatch.sinks.iceberg_history`): a batch already committed (a
rerun, a zombie) commits nothing. The commit is a compare-and-swap on the catalog's pointer
(:mod:`~microbatch.sinks.iceberg_commit`); a loser reloads and checks again.

**Maintenance** (``microbatch optimize``): :meth:`IcebergTarget.optimize`
(:mod:`~microbatch.sinks.iceberg_optimize`) and :meth:`IcebergTarget.vacuum`
(:mod:`~microbatch.sinks.iceberg_expire`), the same interface as the Delta sink's.
"""

from __future__ import annotations

import functools
import json
import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from microbatch.errors import SinkError
from microbatch.settings import Settings
from microbatch.sinks.base import Awaiting
from microbatch.sinks.delta_files import app_tag
from microbatch.sinks.iceberg_commit import commit_snapshot
from microbatch.sinks.iceberg_expire import vacuum
from microbatch.sinks.iceberg_files import (
    batch_prefix,
    data_file,
    data_root,
    staging_attempt,
    write_data_files,
)
from microbatch.sinks.iceberg_history import (
    APP,
    BATCH,
    END_OFFSETS,
    SUPERSEDES,
    UNDOES,
    lineage,
)
from microbatch.sinks.iceberg_optimize import optimize
from microbatch.sinks.iceberg_schema import check_schema, iceberg_schema
from microbatch.sinks.iceberg_table import AppTable
from microbatch.storage import open_store

if TYPE_CHECKING:
    from microbatch.sinks.iceberg import IcebergSink

log = logging.getLogger(__name__)

__all__ = ["MAX_ATTEMPTS", "IcebergTarget"]

#: Commits reloaded and retried after another writer moved the table before giving up.
MAX_ATTEMPTS = 8


class IcebergTarget(AppTable):
    """The sink's table as one pipeline (or, with ``pipeline=None``, any) sees it."""

    def __init__(self, sink: IcebergSink, pipeline: str | None, settings: Settings | None) -> None:
        settings = settings or Settings.from_env()
        super().__init__(sink.catalog_for(settings), sink.table, sink.name, pipeline, settings)
        self.sink = sink
        #: The clock :meth:`vacuum` judges ages by (epoch seconds; tests move it).
        self.clock: Callable[[], float] = time.time

    # Schema -------------------------------------------------------------------------------
    def check_schema(self, table: Any) -> list[pa.Field]:
        """The nullable columns the sink adds, or a :class:`SinkError` naming the column."""
        return check_schema(self.sink.schema, self.sink.partition_by, table, self.where)

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
        if not catalog.namespace_exists(namespace):
            try:
                catalog.create_namespace(namespace)
            except Exception:
                # Stage-2 tasks of a first batch race to create it. pyiceberg's SQL catalog
                # checks, then inserts: a loser gets the database's unique-key error, not
                # NamespaceAlreadyExistsError. Whoever made it, it is there: carry on.
                if not catalog.namespace_exists(namespace):
                    raise
        schema = iceberg_schema(self.sink.schema, self.where)
        tx = catalog.create_table_transaction(self.sink.table, schema=schema)
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
        stem = f"mb-{app_tag(self.app_id)}-b{batch_id:020d}-i{instance:05d}"
        return write_data_files(
            self.ready_table(),
            rows,
            self.sink.partition_by,
            lambda n: f"{stem}-{n:04d}-{attempt or 'x'}.parquet",
            self.settings,
            self.where,
        )

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

        from microbatch.runtime.faults import pause_if  # the kill-and-race tests' hook

        props = {APP: self.app_id, BATCH: str(batch_id), **summary}
        where = f"{self.where} batch {batch_id}"
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
            adds = [data_file(table, f, self.where) for f in files]
            visible = self.visible_batches(table)
            removes = [f for b in sorted(set(supersedes)) for f in visible.get(b, ())]
            if not adds and not removes and UNDOES not in summary:
                return False  # no rows, and the batches it supersedes showed none either
            point = "in_iceberg_overwrite" if removes else "in_iceberg_commit"
            try:
                commit_snapshot(
                    table,
                    adds,
                    removes,
                    props,
                    before_commit=functools.partial(pause_if, point, where),
                )
                pause_if("after_iceberg_commit", where)
                return True
            except CommitFailedException as e:  # another writer moved the table: reload
                log.info("%s: batch %s conflicted (%s); retrying", self.where, batch_id, e)
                last_error = e
                time.sleep(min(0.05 * 2**attempt, 1.0))
        raise SinkError(
            f"{self.where}: could not commit batch {batch_id} after {MAX_ATTEMPTS} attempts "
            f"(other writers keep committing: {last_error}); rerun the batch to publish it"
        )

    # Replacement and GC ---------------------------------------------------------------------
    def awaiting_replacement(self, undone: Iterable[int] = ()) -> Awaiting:
        """Undone batches (recorded by rewinds, plus ``undone``) whose files are visible,
        with the end offsets their snapshots recorded."""
        table = self.load()
        if table is None:
            return {}
        undoes, ends = set(undone), {}
        for _, summary in lineage(table):
            if not self.mine(summary):
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
                    "the oldest interval you backfill (`microbatch optimize --vacuum "
                    "--retention-hours`; other tools: history.expire.max-snapshot-age-ms)"
                )
            out[str(b)] = ends[b]
        return out

    def collect_orphans(self, batches: Sequence[int]) -> int:
        """Delete the files of (long published) ``batches`` that attempts which lost the
        commit left next to the committed ones (same batch and folder, another attempt).
        A file any live snapshot references is never deleted, whatever its name, nor an
        optimize's merged file (one may be about to commit: :meth:`vacuum` takes those)."""
        wanted = set(batches)
        table = self.load() if wanted else None
        if table is None:
            return 0
        referenced = self.referenced_files(table)
        root = data_root(table)
        prefixes = {
            batch_prefix(f.file_path[len(root) :])
            for b, files in self.visible_batches(table).items()
            if b in wanted
            for f in files
            if f.file_path.startswith(root)
        }
        store, deleted = open_store(root, self.settings), 0
        for prefix in sorted(prefixes):
            for key in store.list(prefix):
                if root + key not in referenced and staging_attempt(key) is not None:
                    store.delete(key)
                    deleted += 1
        return deleted

    # Maintenance ---------------------------------------------------------------------------
    def optimize(
        self, dry_run: bool = False, before_commit: Callable[[], None] | None = None
    ) -> dict[str, Any]:
        """Compact this app's files per batch and partition in one ``replace`` snapshot
        (:func:`~microbatch.sinks.iceberg_optimize.optimize`); ``before_commit`` runs right
        before the commit (``microbatch optimize``: a lease check); if it raises, nothing
        is committed and the merged files are deleted."""
        return optimize(self, dry_run, before_commit)

    def vacuum(self, retention_hours: float = 168, dry_run: bool = False) -> list[str]:
        """Expire snapshots older than ``retention_hours`` (keeping what publishing reads),
        then delete this app's data files, manifests and manifest lists no remaining
        snapshot reads and older than that (:mod:`~microbatch.sinks.iceberg_expire`); the
        files deleted (or, with ``dry_run``, to delete). At least 1 h. Run it holding the
        pipeline's lease after publishing any committed batch (``microbatch optimize
        --vacuum`` does)."""
        return vacuum(self, retention_hours, dry_run, self.clock())
