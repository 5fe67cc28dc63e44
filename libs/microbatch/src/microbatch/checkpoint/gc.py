"""Retention and garbage collection of checkpoint objects.

Keep the newest ``keep_last`` committed checkpoints. Then, in this order (so a crash
midway leaves only more garbage, never a retained checkpoint with a missing file):

1. list the manifests and read the retained ones: the files they reference stay;
2. raise the retention floor to the oldest retained id (:mod:`.catalog`), then delete the
   manifests below it — older checkpoints, and orphans of stalled attempts;
3. make sure the decision of step 1 still holds (:func:`is_settled`): no rewind is
   copying a checkpoint (a pin), and no checkpoint committed past the newest of step 1;
   if either, delete no file this time (the next GC will);
4. delete every state file that no retained manifest references and whose checkpoint id
   is at most the newest of step 1 — files of attempts that lost a commit race or crashed
   before committing, and files only removed checkpoints used.

Why step 3 makes a stalled GC safe, whatever its timing. GC may stall anywhere (a zombie:
its lease expired after its last check), and meanwhile another run commits. A batch's
checkpoint names the files of the newest checkpoint (retained by every GC, whatever its
listing: it keeps at least one) plus its own, with an id above any GC's newest. Only a
rewind names the files of an *older* checkpoint, and it pins that one before reading it
again (:mod:`microbatch.runtime.replay`), commits its copy, then unpins. GC removes a
manifest before it lists the pins, and lists the pins before the manifests. So a rewind
that found its source still there pinned it before GC removed it, and GC sees either the
pin or, once the rewind unpinned, the copy it committed: in both cases it deletes nothing.
A rewind that found its source gone commits nothing.

State files with a *higher* id than the newest commit belong to a checkpoint that may
still be in flight and are left alone. A file referenced by any retained manifest —
including old files that incremental checkpoints still point at — is never deleted.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging

from microbatch.checkpoint.catalog import read_listing, read_manifest
from microbatch.checkpoint.layout import Layout
from microbatch.checkpoint.manifest import Manifest
from microbatch.errors import CheckpointError
from microbatch.storage import AlreadyExistsError, ObjectStore

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class GcResult:
    retained: tuple[int, ...]
    deleted_manifests: tuple[int, ...]
    deleted_files: tuple[str, ...]
    kept_files: int
    #: The retained manifests, oldest first (read anyway: callers reuse them).
    manifests: tuple[Manifest, ...] = ()
    #: Whether step 3 found nothing changed since the listing, so what only removed
    #: checkpoints referenced could go; None when there was nothing to delete (not asked).
    settled: bool | None = None


def collect_garbage(store: ObjectStore, layout: Layout, keep_last: int) -> GcResult:
    """Apply retention (see the module docstring); returns what was kept and deleted."""
    if not isinstance(keep_last, int) or keep_last < 1:
        raise CheckpointError(f"keep_last must be an int >= 1 (keep at least one): {keep_last!r}")
    from microbatch.runtime.faults import pause_if  # the kill-and-race tests' hook

    listing = read_listing(store, layout)  # Step 1
    ids = listing.committed
    if not ids:
        for cid in listing.below_floor:
            store.delete(layout.manifest_key(cid))
        return GcResult((), tuple(listing.below_floor), (), 0)
    retained = ids[-keep_last:]
    manifests = tuple(read_manifest(store, layout, cid) for cid in retained)
    referenced: set[str] = set()
    for m in manifests:
        referenced |= m.files()
    newest = ids[-1]
    pause_if("gc_listed", f"GC {store.url}")

    removed = [cid for cid in listing.ids if cid < retained[0]]  # Step 2
    if removed:
        raise_floor(store, layout, retained[0])
        for cid in removed:
            store.delete(layout.manifest_key(cid))
        pause_if("during_gc", f"GC {store.url}")

    candidates, kept = [], 0
    for key in store.list(layout.state):
        cid = layout.state_id(key)
        if cid is None or key in referenced or cid > newest:
            kept += 1
        else:
            candidates.append(key)
    settled = is_settled(store, layout, newest) if candidates else None  # Step 3
    deleted = []
    if settled:
        for key in candidates:  # Step 4
            store.delete(key)
            deleted.append(key)
    else:
        kept += len(candidates)
    for key in listing.floor_keys:  # superseded floors (any GC's): the highest counts
        if (layout.floor_id(key) or 0) < retained[0]:
            store.delete(key)
    log.info(
        "GC %s: kept checkpoints %s, deleted %d manifests and %d state files%s",
        store.url,
        retained,
        len(removed),
        len(deleted),
        "" if settled is not False else " (the rest waits: a rewind or a commit ran meanwhile)",
    )
    return GcResult(tuple(retained), tuple(removed), tuple(deleted), kept, manifests, settled)


def raise_floor(store: ObjectStore, layout: Layout, first_retained: int) -> None:
    """Record, before any manifest below ``first_retained`` goes, that none counts."""
    with contextlib.suppress(AlreadyExistsError):
        store.create(layout.floor_key(first_retained), b"")


def is_settled(store: ObjectStore, layout: Layout, newest: int) -> bool:
    """True if files that only checkpoints up to ``newest`` may reference can go: no
    rewind holds a pin to commit past ``newest``, and no checkpoint above ``newest``
    exists. Call it after removing the manifests (the order the module docstring argues
    from); it also deletes the pins of rewinds that can no longer commit."""
    live = False
    for key in store.list(layout.pins):  # pins first, then manifests
        copy_id = layout.pin_copy_id(key)
        if copy_id is None:
            continue
        if copy_id > newest:
            live = True
        else:  # its id is taken: that rewind committed, or can never commit now
            store.delete(key)
    if live:
        log.info("GC %s: a rewind is copying a checkpoint; files stay until the next GC", store.url)
        return False
    later = [cid for cid in read_listing(store, layout).ids if cid > newest]
    return not later
