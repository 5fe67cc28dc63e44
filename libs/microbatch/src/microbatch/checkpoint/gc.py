"""Retention and garbage collection of checkpoint objects.

Keep the newest ``keep_last`` committed checkpoints. Then, in this order (so a crash
midway leaves only more garbage, never a retained checkpoint with a missing file):

1. delete the manifests of older checkpoints;
2. delete every state file that no retained manifest references and whose checkpoint id
   is at most the newest committed id — files of attempts that lost a commit race or
   crashed before committing, and files only dropped checkpoints used.

State files with a *higher* id than the newest commit belong to a checkpoint that may
still be in flight and are left alone. A file referenced by any retained manifest —
including old files that incremental checkpoints still point at — is never deleted.
"""

from __future__ import annotations

import dataclasses
import logging

from microbatch.checkpoint.catalog import list_checkpoints, load_manifest
from microbatch.checkpoint.layout import Layout
from microbatch.checkpoint.manifest import Manifest
from microbatch.errors import CheckpointError
from microbatch.storage import ObjectStore

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class GcResult:
    retained: tuple[int, ...]
    deleted_manifests: tuple[int, ...]
    deleted_files: tuple[str, ...]
    kept_files: int
    #: The retained manifests, oldest first (read anyway: callers reuse them).
    manifests: tuple[Manifest, ...] = ()


def collect_garbage(store: ObjectStore, layout: Layout, keep_last: int) -> GcResult:
    """Apply retention (see the module docstring); returns what was kept and deleted."""
    if not isinstance(keep_last, int) or keep_last < 1:
        raise CheckpointError(f"keep_last must be an int >= 1 (keep at least one): {keep_last!r}")
    ids = list_checkpoints(store, layout)
    if not ids:
        return GcResult((), (), (), 0)
    retained, dropped = ids[-keep_last:], ids[:-keep_last]
    manifests = tuple(load_manifest(store, layout, cid) for cid in retained)
    referenced: set[str] = set()
    for m in manifests:
        referenced |= m.files()
    newest = ids[-1]

    for cid in dropped:  # Step 1
        store.delete(layout.manifest_key(cid))
    if dropped:
        from microbatch.runtime.faults import pause_if  # the kill-and-race tests' hook

        pause_if("during_gc", f"GC {store.url}")
    deleted, kept = [], 0
    for key in store.list(layout.state):  # Step 2
        cid = layout.state_id(key)
        if cid is None or key in referenced or cid > newest:
            kept += 1
            continue
        store.delete(key)
        deleted.append(key)
    log.info(
        "GC %s: kept checkpoints %s, deleted %d manifests and %d state files",
        store.url,
        retained,
        len(dropped),
        len(deleted),
    )
    return GcResult(tuple(retained), tuple(dropped), tuple(deleted), kept, manifests)
