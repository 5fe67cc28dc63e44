"""Finding and loading committed checkpoints of one pipeline."""

from __future__ import annotations

from microbatch.checkpoint.layout import Layout
from microbatch.checkpoint.manifest import Manifest
from microbatch.errors import CheckpointError
from microbatch.storage import ObjectNotFoundError, ObjectStore


def list_checkpoints(store: ObjectStore, layout: Layout) -> list[int]:
    """Ids of committed checkpoints (those with a manifest), ascending."""
    ids = (layout.manifest_id(k) for k in store.list(layout.manifests))
    return sorted(i for i in ids if i is not None)


def load_manifest(store: ObjectStore, layout: Layout, checkpoint_id: int) -> Manifest:
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
    """The newest committed checkpoint, or None before the first commit."""
    ids = list_checkpoints(store, layout)
    return load_manifest(store, layout, ids[-1]) if ids else None
