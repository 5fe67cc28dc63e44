"""Expiring the Iceberg sink's old snapshots, then deleting the files no live snapshot reads
(``microbatch optimize --vacuum``).

1. **Expire** the snapshots older than the retention, except:

   - the heads of branches and tags, and the ``history.expire.min-snapshots-to-keep``
     newest snapshots of the current lineage (default 1: the current one);
   - the current snapshot's ancestry down to the oldest snapshot that answers an app's
     "newest batch committed" (:func:`~microbatch.sinks.iceberg_history.published_marks`):
     a retried or zombie publish finds its batch committed exactly as before, whichever
     snapshots went. An optimize's snapshot carries every app's answer, so after one only
     the snapshots since are kept for that.

   One metadata commit, a compare-and-swap on the current snapshot: if anything committed
   meanwhile, it plans again on the new table.

2. **Sweep orphans** older than the retention that no remaining snapshot reads:

   - this app's data files (``mb-<app>-…``): files of attempts whose checkpoint never
     committed, files a backfill or an optimize removed once the snapshots that still
     read them expired, merged files of an optimize that never committed;
   - manifests and manifest lists (``.avro`` in the metadata folder) no remaining snapshot
     lists.

   Other writers' and other apps' data files are left alone (another pipeline may hold a
   committed batch it has not published yet), and so are ``*.metadata.json`` files.

Age is the file's modification time, and the retention is at least one hour: files an
optimize or a publish has written but not committed yet are younger than that. Run it
holding the pipeline's lease, after publishing any committed batch (``microbatch optimize
--vacuum`` does): then none of the app's staged files still awaits its publish.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Iterator
from typing import Any

from microbatch.errors import ConfigError, SinkError
from microbatch.sinks.iceberg_files import FILE, data_root, metadata_root
from microbatch.sinks.iceberg_history import lineage, published_marks
from microbatch.sinks.iceberg_table import AppTable
from microbatch.storage import open_store

log = logging.getLogger(__name__)

__all__ = ["MIN_RETENTION_HOURS", "expirable", "orphans", "vacuum"]

#: Commits planned again after another writer moved the table before expiry gives up.
MAX_ATTEMPTS = 8
#: Files younger than this may belong to a commit still under way.
MIN_RETENTION_HOURS = 1.0


def vacuum(view: AppTable, retention_hours: float, dry_run: bool, now_s: float) -> list[str]:
    """Expire ``view``'s table's snapshots older than ``retention_hours`` (before ``now_s``,
    epoch seconds), then delete the orphans older than that; the orphans' paths (with
    ``dry_run``, what it would delete; nothing changes)."""
    if retention_hours < MIN_RETENTION_HOURS:
        raise ConfigError(
            f"{view.where}: vacuum retention {retention_hours} h is below "
            f"{MIN_RETENTION_HOURS:g} h: files another writer has written but not committed "
            "yet would be deleted"
        )
    if view.pipeline is None:
        raise ConfigError(f"{view.where}: vacuum needs the pipeline whose files it deletes")
    cutoff_ms = int((now_s - retention_hours * 3600) * 1000)
    table, expired = expire_snapshots(view, cutoff_ms, dry_run)
    if table is None:
        return []
    live = [s for s in table.snapshots() if s.snapshot_id not in expired]
    found = orphans(view, table, live, cutoff_ms)
    if not dry_run:
        # With the store the sink writes with (pyarrow's S3 file system would leave a
        # folder marker where it deletes a folder's last file).
        roots = sorted({data_root(table), metadata_root(table)}, key=len, reverse=True)
        stores = {root: open_store(root, view.settings) for root in roots}
        for uri in found:
            root = next(r for r in roots if uri.startswith(r))
            stores[root].delete(uri[len(root) :])
        log.info("%s: deleted %s orphan files", view.where, len(found))
    return found


def expire_snapshots(view: AppTable, cutoff_ms: int, dry_run: bool) -> tuple[Any, set[int]]:
    """(the table after the expiry, the ids expired); with ``dry_run``, the table as it is
    and the ids it would expire."""
    from pyiceberg.exceptions import CommitFailedException
    from pyiceberg.table.refs import MAIN_BRANCH
    from pyiceberg.table.update import AssertRefSnapshotId, AssertTableUUID, RemoveSnapshotsUpdate

    last_error: Exception | None = None
    for attempt in range(MAX_ATTEMPTS):
        table = view.load()
        if table is None:
            return None, set()
        ids = expirable(table, cutoff_ms)
        if dry_run or not ids:
            return table, ids
        head = table.current_snapshot()  # not None: ids would be empty
        requirements = (
            AssertTableUUID(uuid=table.metadata.table_uuid),
            AssertRefSnapshotId(ref=MAIN_BRANCH, snapshot_id=head.snapshot_id),
        )
        try:
            table.catalog.commit_table(
                table, requirements, (RemoveSnapshotsUpdate(snapshot_ids=sorted(ids)),)
            )
        except CommitFailedException as e:  # another writer moved the table: plan again
            last_error = e
            time.sleep(min(0.05 * 2**attempt, 1.0))
            continue
        log.info("%s: expired %s snapshots: %s", view.where, len(ids), sorted(ids))
        return view.load(), ids
    raise SinkError(
        f"{view.where}: could not expire snapshots after {MAX_ATTEMPTS} attempts (other "
        f"writers keep committing: {last_error}); run it again"
    )


def expirable(table: Any, cutoff_ms: int) -> set[int]:
    """The snapshots older than ``cutoff_ms`` that nothing keeps (the module's step 1)."""
    keep = set(published_marks(table)[1])
    keep |= {ref.snapshot_id for ref in table.metadata.refs.values()}
    newest = int(table.properties.get("history.expire.min-snapshots-to-keep", 1))
    keep |= {s.snapshot_id for s, _ in itertools.islice(lineage(table), max(newest, 1))}
    return {
        s.snapshot_id
        for s in table.snapshots()
        if s.timestamp_ms < cutoff_ms and s.snapshot_id not in keep
    }


def orphans(view: AppTable, table: Any, live: list[Any], cutoff_ms: int) -> list[str]:
    """The files older than ``cutoff_ms`` that none of the ``live`` snapshots reads (the
    module's step 2), sorted."""
    io = _io(table)
    parse = lambda uri: io.parse_location(uri, io.properties)[2]  # noqa: E731
    manifests = {m.manifest_path: m for s in live for m in s.manifests(table.io)}
    needed = {s.manifest_list for s in live} | set(manifests)
    needed |= {
        entry.data_file.file_path
        for m in manifests.values()
        for entry in m.fetch_manifest_entry(table.io, discard_deleted=True)
    }
    needed_paths = {parse(uri) for uri in needed}
    tag = view.app_tag()

    def apps_data_file(path: str) -> bool:
        m = FILE.search(path)
        return m is not None and m["app"] == tag

    out = []
    for root, recursive, wanted in (
        (data_root(table), True, apps_data_file),
        (metadata_root(table), False, lambda path: path.endswith(".avro")),
    ):
        for uri, path, mtime_ms in _listing(io, root, recursive):
            old = mtime_ms is not None and mtime_ms < cutoff_ms
            if old and path not in needed_paths and wanted(path):
                out.append(uri)
    return sorted(out)


def _listing(io: Any, root: str, recursive: bool) -> Iterator[tuple[str, str, int | None]]:
    """(URI, path in its file system, modification time in ms or None) of the files under
    ``root`` (a URI ending in '/')."""
    from pyarrow.fs import FileSelector, FileType

    scheme, netloc, base = io.parse_location(root, io.properties)
    base = base.rstrip("/")
    selector = FileSelector(base, recursive=recursive, allow_not_found=True)
    for info in io.fs_by_scheme(scheme, netloc).get_file_info(selector):
        if info.type != FileType.File:
            continue
        mtime = None if info.mtime_ns is None else info.mtime_ns // 1_000_000
        yield root + info.path[len(base) + 1 :], info.path, mtime


def _io(table: Any) -> Any:
    from pyiceberg.io.pyarrow import PyArrowFileIO

    return table.io if isinstance(table.io, PyArrowFileIO) else PyArrowFileIO(table.io.properties)
