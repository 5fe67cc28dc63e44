"""Finding and loading committed checkpoints of one pipeline.

A committed checkpoint is a manifest at or above the retention floor (the layout's
``manifests/floor-<id>``, written by GC before it removes anything below it). A manifest
found below the floor is not one: either GC has yet to remove it, or a stalled attempt
created it after GC removed the checkpoint of that id — it passed the test that its id
comes right after the newest, then slept while other runs committed past it. Such an
*orphan* names files GC may already have deleted, so no reader takes it: not the listing,
not the newest, not a rewind's walk back through the lineage.
"""

from __future__ import annotations

import dataclasses

from microbatch.checkpoint.layout import Layout
from microbatch.checkpoint.manifest import Manifest
from microbatch.errors import CheckpointError
from microbatch.storage import ObjectNotFoundError, ObjectStore


@dataclasses.dataclass(frozen=True)
class CheckpointListing:
    """One listing of ``manifests/``: every manifest id found, ascending, and the
    retention floor (0 when GC never removed anything)."""

    ids: tuple[int, ...]
    floor: int = 0
    floor_keys: tuple[str, ...] = ()

    @property
    def committed(self) -> list[int]:
        """The committed checkpoints: the ids at or above the floor."""
        return [i for i in self.ids if i >= self.floor]

    @property
    def below_floor(self) -> list[int]:
        """Manifests retention removed, or is removing, or orphans of stalled attempts."""
        return [i for i in self.ids if i < self.floor]


def read_listing(store: ObjectStore, layout: Layout) -> CheckpointListing:
    """Manifest ids and the retention floor, from one listing."""
    ids, floors = [], []
    for key in store.list(layout.manifests):
        cid = layout.manifest_id(key)
        if cid is not None:
            ids.append(cid)
        elif layout.floor_id(key) is not None:
            floors.append(key)
    floor = max((layout.floor_id(k) or 0 for k in floors), default=0)
    return CheckpointListing(tuple(sorted(ids)), floor, tuple(sorted(floors)))


def list_checkpoints(store: ObjectStore, layout: Layout) -> list[int]:
    """Ids of committed checkpoints (manifests at or above the retention floor), ascending."""
    return read_listing(store, layout).committed


def retention_floor(store: ObjectStore, layout: Layout) -> int:
    """The lowest id retention still keeps (0 when it never removed anything)."""
    return read_listing(store, layout).floor


def load_manifest(store: ObjectStore, layout: Layout, checkpoint_id: int) -> Manifest:
    """Committed checkpoint ``checkpoint_id``; a :class:`CheckpointError` when there is
    none, also when the manifest there lies below the retention floor (an orphan).

    The floor is read *after* the manifest: GC writes it before removing a checkpoint, so
    an orphan, created after that removal, is always seen below it."""
    manifest = read_manifest(store, layout, checkpoint_id)
    floor = retention_floor(store, layout)
    if checkpoint_id < floor:
        raise CheckpointError(
            f"checkpoint {checkpoint_id} ({store.url}/{layout.manifest_key(checkpoint_id)}): "
            f"no such committed checkpoint: retention removed every checkpoint below "
            f"{floor} (a manifest still found there is one GC has yet to delete, or an "
            "orphan a stalled attempt created after GC; either is ignored). Use a "
            "retained checkpoint: `microbatch checkpoints` lists them"
        )
    return manifest


def read_manifest(store: ObjectStore, layout: Layout, checkpoint_id: int) -> Manifest:
    """The manifest at ``checkpoint_id`` as stored, without asking the retention floor:
    for callers that took the id from a listing they just made."""
    key = layout.manifest_key(checkpoint_id)
    where = f"checkpoint {checkpoint_id} ({store.url}/{key})"
    try:
        data = store.get(key)
    except ObjectNotFoundError:
        raise CheckpointError(f"{where}: no such committed checkpoint") from None
    manifest = Manifest.from_json(data, where)
    if manifest.checkpoint_id != checkpoint_id:
        raise CheckpointError(f"{where}: manifest says checkpoint {manifest.checkpoint_id}")
    return manifest


def latest_manifest(store: ObjectStore, layout: Layout) -> Manifest | None:
    """The newest committed checkpoint, or None before the first commit. (An orphan is
    never the newest: runs committed past its id before it was created.)"""
    ids = list_checkpoints(store, layout)
    return read_manifest(store, layout, ids[-1]) if ids else None
