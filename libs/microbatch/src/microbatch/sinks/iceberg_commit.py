"""One Iceberg snapshot, committed at most once: a compare-and-swap on the table's head
that the caller retries, never pyiceberg.

pyiceberg retries a failed commit by itself, re-applying the snapshot on the new head
without the caller's checks (a batch already committed, files replaced meanwhile): a
zombie's batch would land twice. :func:`commit_snapshot` commits from a copy of the loaded
table whose retries are 0 (nothing is stored), so a moved head is a
``CommitFailedException`` for the caller to handle (pyiceberg deletes the manifests it
wrote for it).

Operations: ``append`` (files added), ``overwrite`` (files removed, and maybe added: a
backfill's replacement), ``replace`` (the same rows in other files: a compaction; streaming
readers skip it). pyiceberg 0.12 writes no ``replace`` snapshot itself; :class:`_Replace`
is its overwrite with the operation named so.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

__all__ = ["commit_snapshot"]


def commit_snapshot(
    table: Any,
    adds: Sequence[Any],
    removes: Sequence[Any],
    props: Mapping[str, str],
    *,
    replace: bool = False,
    before_commit: Callable[[], None] | None = None,
) -> int:
    """Commit one snapshot adding ``adds`` and removing ``removes`` (``DataFile``s) on top
    of ``table``'s head, its summary carrying ``props``; its id. ``CommitFailedException``
    if the head moved since ``table`` was loaded. ``before_commit`` runs after the
    manifests are written (and checked to be still there), right before the catalog's
    compare-and-swap: if it raises, they are deleted and nothing is committed."""
    from pyiceberg.table import Table, TableProperties

    no_retry = {**table.metadata.properties, TableProperties.COMMIT_NUM_RETRIES: "0"}
    table = Table(
        table.name(),
        table.metadata.model_copy(update={"properties": no_retry}),
        table.metadata_location,
        table.io,
        table.catalog,
    )
    tx = table.transaction()
    update = tx.update_snapshot(snapshot_properties=dict(props))
    if replace:
        producer: Any = _replace(update)
    else:
        producer = update.overwrite() if removes else update.fast_append()
    with producer as snapshot:
        for data_file in adds:
            snapshot.append_data_file(data_file)
        for data_file in removes:
            snapshot.delete_data_file(data_file)
    if before_commit is not None:
        try:
            _check_written(producer, table.io)
            before_commit()  # last: when it returns, the commit is sent
        except BaseException:
            producer._clean_all_uncommitted()  # the manifests no commit will name
            raise
    tx.commit_transaction()
    return int(producer.snapshot_id)


def _check_written(producer: Any, io: Any) -> None:
    """The manifests and manifest list the snapshot names are still there (an orphan
    cleanup with a clock far off could have taken them meanwhile)."""
    written = [*producer._written_manifests, *producer._written_manifest_lists]
    gone = [path for path in written if not io.new_input(path).exists()]
    if gone:
        raise FileNotFoundError(f"the snapshot's manifests {gone} were deleted before its commit")


def _replace(update: Any) -> Any:
    """A ``replace`` snapshot producer for ``update`` (pyiceberg's ``UpdateSnapshot``)."""
    from pyiceberg.table.snapshots import Operation, Summary
    from pyiceberg.table.update.snapshot import _OverwriteFiles

    class _Replace(_OverwriteFiles):
        def _summary(self, snapshot_properties: Any = None) -> Any:
            # pyiceberg's running totals know append, overwrite and delete only; a
            # replace's are an overwrite's (files and rows added and removed).
            self._operation = Operation.OVERWRITE
            try:
                summary = super()._summary(snapshot_properties or {})
            finally:
                self._operation = Operation.REPLACE
            return Summary(Operation.REPLACE, **summary.additional_properties)

    return _Replace(
        operation=Operation.REPLACE,
        transaction=update._transaction,
        io=update._io,
        branch=update._branch,
        snapshot_properties=update._snapshot_properties,
    )
