"""Upkeep of a Delta sink's table: compaction (``microbatch optimize``), vacuum, and the
checkpoint GC's deletion of files staged by attempts that lost a batch's commit.

Every function takes the :class:`~microbatch.sinks.delta_target.DeltaTarget` of the table as
one pipeline sees it; none of them changes a row a reader sees.
"""

from __future__ import annotations

import contextlib
import json
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from microbatch.errors import ConfigError, SinkError
from microbatch.sinks.delta_files import (
    DATA_FILE,
    app_of,
    batch_prefix,
    file_stats,
    staging_attempt,
)
from microbatch.sinks.parquet import encode_parquet
from microbatch.storage import ObjectNotFoundError

if TYPE_CHECKING:
    from microbatch.sinks.delta_target import DeltaTarget

#: Optimize commits re-planned after a conflict before it gives up.
OPTIMIZE_ATTEMPTS = 8


def collect_orphans(target: DeltaTarget, batches: Sequence[int]) -> int:
    """Delete what attempts that lost the commit of (long published) ``batches``
    staged: files of the same app and batch, in its folders (its rows, so partitions,
    are the same in every attempt), with another attempt's id. Only those provably no
    table version ever references: a batch is committed once (its app transaction),
    with the files of one attempt, whose id the snapshot shows. Everything else is
    left to :meth:`vacuum` and its retention: an optimize's merged files (one may be
    about to commit), the files an optimize or a replacement removed (older versions
    still read them), and a batch whose own files the snapshot no longer shows."""
    wanted = set(batches)
    dt = target.load() if wanted else None
    if dt is None:
        return 0
    deleted, store = 0, target.store()
    for b, files in target.visible_batches(dt).items():
        if b not in wanted:
            continue
        by_app: dict[str, list[str]] = {}
        for f in files:
            by_app.setdefault(app_of(f["path"]), []).append(f["path"])
        for paths in by_app.values():
            winner = {staging_attempt(p) for p in paths} - {None}
            if not winner:
                continue  # compacted: which attempt won is in no file it shows
            for folder, prefix in {batch_prefix(p) for p in paths}:
                for key in store.list(folder + prefix):
                    attempt = staging_attempt(key)
                    if attempt is not None and attempt not in winner:
                        store.delete(key)
                        deleted += 1
    return deleted


def optimize(
    target: DeltaTarget, dry_run: bool = False, before_commit: Callable[[], None] | None = None
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
    for attempt in range(OPTIMIZE_ATTEMPTS):
        dt = target.load()
        groups: dict[tuple[int, str], list[dict[str, Any]]] = {}
        for b, files in ({} if dt is None else target.visible_batches(dt)).items():
            for f in files:
                groups.setdefault((b, f["path"].rpartition("/")[0]), []).append(f)
        groups = {k: sorted(fs, key=lambda f: f["path"]) for k, fs in groups.items()
                  if len(fs) > 1}  # fmt: skip
        summary = {
            "table": target.sink.table_uri,
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
            path, changes = _compact(target, dt.version(), fs, token)
            merged.append(path)
            actions.extend(changes)
        counts = {k: summary[k] for k in ("batches", "files_before", "files_after")}
        info = {"app": target.app_id, "optimize": counts}
        try:
            pause_if("in_delta_optimize", f"{target.where} optimize")
            if before_commit is not None:
                before_commit()
        except Exception:
            _discard(target, merged)
            raise
        try:
            dt.create_write_transaction(
                actions,
                mode="append",
                schema=dt.schema(),
                partition_by=list(target.sink.partition_by) or None,
                commit_properties=CommitProperties(custom_metadata={"microbatch": info}),
            )
        except CommitFailedError as e:  # a batch replaced meanwhile: plan again
            _discard(target, merged)
            last_error = e
            time.sleep(min(0.05 * 2**attempt, 1.0))
            continue
        summary["version"] = target.load().version()
        return summary
    raise SinkError(f"{target.where}: optimize kept conflicting ({last_error}); run it again")


def _discard(target: DeltaTarget, paths: Iterable[str]) -> None:
    """Delete merged files no commit took (their names are this optimize's own)."""
    store = target.store()
    for path in paths:
        with contextlib.suppress(ObjectNotFoundError):
            store.delete(path)


def _compact(
    target: DeltaTarget, version: int, files: Sequence[Mapping[str, Any]], token: str
) -> tuple[str, list[Any]]:
    """The merged file written for ``files`` (one batch, one partition; named after the
    batch, the version planned on and ``token``, this optimize's) and the actions
    replacing them by it."""
    import io

    import pyarrow.parquet as pq
    from deltalake.transaction import AddAction, RemoveAction

    store, now = target.store(), int(time.time() * 1000)
    merged = pa.concat_tables(
        [pq.read_table(io.BytesIO(store.get(f["path"]))) for f in files],
        promote_options="default",
    )
    m = DATA_FILE.search(files[0]["path"])
    assert m is not None  # visible_batches matched it
    folder, _, _ = files[0]["path"].rpartition("/")
    name = f"mb-{m['app']}-b{m['batch']}-i{m['instance']}-0000-merged-v{version}_{token}.parquet"
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


def vacuum(target: DeltaTarget, retention_hours: float = 168, dry_run: bool = False) -> list[str]:
    """Delete files no version newer than ``retention_hours`` references: replaced
    batches' files (time travel to them ends) and files of attempts whose checkpoint
    never committed. Run it holding the pipeline's lease, after publishing any
    committed batch (``microbatch optimize --vacuum`` does): then no file a checkpoint
    still has to publish is unreferenced. At least 1 hour, so files another writer is
    about to commit survive."""
    if retention_hours < 1:
        raise ConfigError(
            f"{target.where}: vacuum retention {retention_hours} h is below 1 h: files "
            "another writer staged but has not committed yet would be deleted"
        )
    dt = target.load()
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
