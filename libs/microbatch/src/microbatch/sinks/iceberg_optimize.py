"""Compaction of the Iceberg sink's small files, batch by batch (``microbatch optimize``).

Each batch adds one file per operator instance and partition value. :func:`optimize` merges
an app's files per **batch and partition** into files of up to the table's target size
(``write.target-file-size-bytes``, 512 MiB), in ONE ``replace`` snapshot: the rows stay the
same (a streaming reader skips the snapshot), files of different batches never merge, and a
merged file keeps its batch's name, so a later backfill still finds the batch and replaces
exactly its rows. The snapshot carries every app's newest batch (``microbatch.published``),
so the batch snapshots behind it may expire without a retried publish committing twice.

The steps:

1. **plan** on the table as loaded: groups of two or more of a batch's files in one
   partition (files at the target size stay as they are);
2. **merge** each group into a file named after the batch, the snapshot planned on and a
   token of this run (``...-merged-s<snapshot>_<token>.parquet``: no GC of losing attempts
   takes it for theirs);
3. **check**, with the snapshot's manifests written: ``before_commit()`` (``microbatch
   optimize``: the pipeline's lease), then the merged files are all still there; if either
   fails, the merged files and manifests are deleted and nothing is committed;
4. **commit**: a compare-and-swap on the head planned on. If anything committed meanwhile
   (a batch published or replaced, another writer), the merged files are deleted and it
   plans again, up to :data:`MAX_ATTEMPTS` times. A commit whose outcome is unknown (the
   catalog failed mid-way) deletes nothing: the files stay for the orphan sweep
   (:mod:`microbatch.sinks.iceberg_expire`), which deletes them only if no snapshot
   names them.

The files a merge replaced stay readable by older snapshots (time travel) until those
expire. A table with delete files (another writer's row-level deletes) is not compacted:
merging would drop the rows' positions the deletes name.
"""

from __future__ import annotations

import dataclasses
import io
import json
import logging
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import pyarrow as pa

from microbatch.errors import SinkError
from microbatch.sinks.iceberg_commit import commit_snapshot
from microbatch.sinks.iceberg_files import FILE, data_file, data_root, describe
from microbatch.sinks.iceberg_history import APP, OPTIMIZE, PUBLISHED, published_marks
from microbatch.sinks.iceberg_table import AppTable
from microbatch.sinks.parquet import encode_parquet
from microbatch.storage import ObjectStore, open_store

log = logging.getLogger(__name__)

__all__ = ["MAX_ATTEMPTS", "Merge", "optimize", "plan"]

#: Plans made again after a commit conflict before optimize gives up.
MAX_ATTEMPTS = 8
#: Iceberg's default ``write.target-file-size-bytes``.
TARGET_FILE_BYTES = 512 * 1024 * 1024


@dataclasses.dataclass(frozen=True)
class Merge:
    """Files of one batch in one partition folder (``DataFile``s, in path order) that become
    one file, the ``index``-th merge of that batch and folder."""

    batch: int
    index: int
    files: tuple[Any, ...]

    def __post_init__(self) -> None:
        if len(self.files) < 2:
            raise ValueError(f"a merge of batch {self.batch} needs 2 files or more")


def plan(view: AppTable, table: Any, target_bytes: int) -> list[Merge]:
    """The merges of ``view``'s visible files in ``table``'s current snapshot."""
    groups: dict[tuple[int, int, str], list[Any]] = {}
    for batch, files in view.visible_batches(table).items():
        for f in files:
            groups.setdefault((batch, f.spec_id, f.file_path.rpartition("/")[0]), []).append(f)
    return [
        Merge(batch, index, tuple(files))
        for (batch, _, _), group in sorted(groups.items())
        for index, files in enumerate(_pack(group, target_bytes))
    ]


def _pack(files: Sequence[Any], target_bytes: int) -> list[list[Any]]:
    """``files`` in path order, cut into runs of up to ``target_bytes``; runs of one file
    (and files at the target already) are left out."""
    runs: list[list[Any]] = [[]]
    size = 0
    for f in sorted(files, key=lambda f: f.file_path):
        if f.file_size_in_bytes >= target_bytes:
            continue
        if runs[-1] and size + f.file_size_in_bytes > target_bytes:
            runs.append([])
            size = 0
        runs[-1].append(f)
        size += f.file_size_in_bytes
    return [run for run in runs if len(run) > 1]


def optimize(
    view: AppTable,
    dry_run: bool = False,
    before_commit: Callable[[], None] | None = None,
    target_bytes: int | None = None,
) -> dict[str, Any]:
    """Compact ``view``'s files per batch and partition in one ``replace`` snapshot (the
    module's steps); what it did (or, with ``dry_run``, would do): ``{"table", "batches",
    "files_before", "files_after", "snapshot"}``, ``snapshot`` the new one's id or None."""
    from pyiceberg.exceptions import CommitFailedException, ValidationException

    last_error: Exception | None = None
    for attempt in range(MAX_ATTEMPTS):
        table = view.load()  # Step 1
        target = target_bytes or _target_bytes(table)
        merges = [] if table is None else plan(view, table, target)
        summary: dict[str, Any] = {"table": view.identifier, **_counts(merges), "snapshot": None}
        if merges and _has_delete_files(table):
            reason = "the table has delete files (row-level deletes of another writer)"
            log.warning("%s: not compacting: %s", view.where, reason)
            return {**summary, "files_after": summary["files_before"], "skipped": reason}
        if dry_run or not merges:
            return summary
        run = _Run(view, table, before_commit)
        try:
            return {**summary, **run.compact(merges)}
        except (CommitFailedException, ValidationException) as e:  # moved meanwhile: again
            run.discard()
            last_error = e
            log.info("%s: optimize conflicted (%s); planning again", view.where, e)
            time.sleep(min(0.05 * 2**attempt, 1.0))
        except BaseException:
            if not run.sent:  # nothing reached the catalog: the merged files are no one's
                run.discard()
            raise
    raise SinkError(f"{view.where}: optimize kept conflicting ({last_error}); run it again")


@dataclasses.dataclass
class _Run:
    """One plan of :func:`optimize` on ``table``, from its merged files to its commit."""

    view: AppTable
    table: Any
    before_commit: Callable[[], None] | None
    #: The merged files written, committed or not.
    written: list[str] = dataclasses.field(default_factory=list)
    #: The commit went to the catalog: if it failed otherwise than by a conflict, its
    #: outcome is unknown, and the merged files must stay.
    sent: bool = False

    def compact(self, merges: Sequence[Merge]) -> dict[str, Any]:
        """Steps 2 to 4: the counts of what was merged and the snapshot committed."""
        adds, removes, done = [], [], []
        token = f"s{self.table.current_snapshot().snapshot_id}_{uuid.uuid4().hex[:8]}"
        for merge in merges:  # Step 2
            merged = _merge(self.view, self.table, self.store(), merge, token, self.written)
            if merged is not None:
                adds.append(merged)
                removes.extend(merge.files)
                done.append(merge)
        counts = _counts(done)
        if not done:
            return {**counts, "snapshot": None}
        props = {
            OPTIMIZE: json.dumps(counts, sort_keys=True),
            PUBLISHED: json.dumps(published_marks(self.table)[0], sort_keys=True),
        }
        if self.view.pipeline is not None:
            props[APP] = self.view.app_id
        snapshot = commit_snapshot(  # Step 4
            self.table, adds, removes, props, replace=True, before_commit=self.check
        )
        log.info("%s: compacted %s in snapshot %s", self.view.where, counts, snapshot)
        return {**counts, "snapshot": snapshot}

    def check(self) -> None:
        """Step 3, with the snapshot's manifests written: ``before_commit``, then are the
        merged files still there (a cleanup may have taken them for orphans while this
        run stalled)?"""
        if self.before_commit is not None:
            self.before_commit()
        store, root = self.store()
        gone = [p for p in self.written if not store.exists(p[len(root) :])]
        if gone:
            raise SinkError(
                f"{self.view.where}: optimize's merged files {gone} were deleted before its "
                "commit (a cleanup took them for orphans); nothing was committed, run it again"
            )
        self.sent = True

    def discard(self) -> None:
        """Delete the merged files (no commit took them: their names are this run's)."""
        store, root = self.store()
        for path in self.written:
            try:
                store.delete(path[len(root) :])
            except Exception as e:  # the orphan sweep takes it later
                log.warning("%s: could not delete merged file %s: %s", self.view.where, path, e)

    def store(self) -> tuple[ObjectStore, str]:
        """The table's data folder, as the store the sink writes with, and its URI."""
        root = data_root(self.table)
        return open_store(root, self.view.settings), root


def _merge(
    view: AppTable,
    table: Any,
    data: tuple[ObjectStore, str],
    merge: Merge,
    token: str,
    written: list[str],
) -> Any:
    """Write ``merge``'s merged file into ``data`` (the data folder's store and URI; its
    path appended to ``written`` first); its ``DataFile``, or None if the files are not all
    in the data folder or their columns differ (a schema change between them): then they
    stay as they are."""
    import pyarrow.parquet as pq
    from pyiceberg.io.pyarrow import pyarrow_to_schema

    store, root = data
    if not all(f.file_path.startswith(root) for f in merge.files):
        log.warning("%s: batch %s: files outside %s are not merged", view.where, merge.batch,
                    root)  # fmt: skip
        return None
    parts = [pq.read_table(io.BytesIO(store.get(f.file_path[len(root) :]))) for f in merge.files]
    if any(_columns(p.schema) != _columns(parts[0].schema) for p in parts[1:]):
        log.warning(
            "%s: batch %s: files with other columns are not merged", view.where, merge.batch
        )
        return None
    rows = pa.concat_tables(parts)
    first = merge.files[0]
    m = FILE.search(first.file_path)
    assert m is not None  # visible_batches matched it
    folder = first.file_path.rpartition("/")[0]
    path = (
        f"{folder}/mb-{m['app']}-b{m['batch']}-i{m['instance']}-{merge.index:04d}-"
        f"merged-{token}.parquet"
    )
    body = encode_parquet(rows)
    written.append(path)
    store.put(path[len(root) :], body)
    partition = [first.partition[i] for i in range(len(first.partition))]
    entry = describe(
        body, path, first.spec_id, partition, pyarrow_to_schema(rows.schema), table.properties
    )
    return data_file(table, entry, view.where, check_ids=False)


def _counts(merges: Sequence[Merge]) -> dict[str, int]:
    return {
        "batches": len({m.batch for m in merges}),
        "files_before": sum(len(m.files) for m in merges),
        "files_after": len(merges),
    }


def _columns(schema: pa.Schema) -> list[tuple[Any, ...]]:
    return [(f.name, f.type, f.nullable, f.metadata) for f in schema]


def _has_delete_files(table: Any) -> bool:
    from pyiceberg.manifest import ManifestContent

    snapshot = table.current_snapshot()
    return snapshot is not None and any(
        m.content == ManifestContent.DELETES for m in snapshot.manifests(table.io)
    )


def _target_bytes(table: Any) -> int:
    if table is None:
        return TARGET_FILE_BYTES
    return int(table.properties.get("write.target-file-size-bytes", TARGET_FILE_BYTES))
