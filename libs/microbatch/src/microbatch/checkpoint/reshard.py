"""Offline reshard: rewrite a checkpoint for a different ``max_parallelism``.

``max_parallelism`` fixes the key → key-group mapping, so changing it moves every key.
This reads every key-group of the source checkpoint (sorted runs or format 1; each keyed
step of a dataflow in turn), re-assigns
each key to ``key_group(key, new_max_parallelism)``, writes a checkpoint of sorted runs
(one run per instance; id ``target_id``, default source + 1) at ``parallelism``
instances, reads it back and verifies that the number of keys and an order-independent
checksum of all state rows are unchanged — before committing it. Run it while the
pipeline is stopped.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Iterable, Mapping
from typing import Any

from microbatch.checkpoint.catalog import load_manifest
from microbatch.checkpoint.layout import Layout
from microbatch.checkpoint.manifest import Manifest
from microbatch.checkpoint.restore import empty_backends, restore_groups
from microbatch.checkpoint.writer import (
    InstanceSnapshot,
    build_manifest,
    commit_manifest,
    write_instance_run,
)
from microbatch.errors import CheckpointError
from microbatch.keygroups import KeyGroupRange, check_max_parallelism, key_group_of_bytes
from microbatch.state.backend import ROW_COLUMNS, KeyedStateBackend, empty_rows
from microbatch.state.codec import encode_canonical
from microbatch.storage import ObjectStore


@dataclasses.dataclass(frozen=True)
class ReshardResult:
    source: int
    target: Manifest
    keys: int
    checksum: str


def state_digest(backends: Iterable[KeyedStateBackend]) -> tuple[int, str]:
    """(number of keys, checksum of every state row) — independent of key-group layout.

    Each row is hashed with its position among the rows of the same (state, key), so list
    order counts but key-group placement does not; row hashes are summed mod 2**128.
    """
    keys: set[bytes] = set()
    total = 0
    for backend in backends:
        for kg in backend.groups_with_state():
            rows = backend.export_rows(kg)
            ordinal: dict[tuple[str, bytes], int] = {}
            for row in zip(*(rows[c] for c in ROW_COLUMNS), strict=True):
                keys.add(row[2])
                pos = ordinal[row[0], row[2]] = ordinal.get((row[0], row[2]), -1) + 1
                digest = hashlib.blake2b(encode_canonical((*row, pos)), digest_size=16).digest()
                total = (total + int.from_bytes(digest, "big")) % 2**128
    return len(keys), f"{total:032x}"


def _regrouped(
    store: ObjectStore, view: Manifest, new_max_parallelism: int, parallelism: int
) -> tuple[list[KeyedStateBackend], tuple[int, str]]:
    """One keyed step's state (``view``: the checkpoint as that step sees it) re-assigned to
    the key-groups of ``new_max_parallelism`` over ``parallelism`` instances, and its
    digest before (row order within a key is kept)."""
    old = KeyedStateBackend(view.max_parallelism, KeyGroupRange(0, view.max_parallelism - 1))
    restore_groups(store, view, old, range(view.max_parallelism))
    before = state_digest([old])
    regrouped: dict[int, dict[str, list]] = {}
    for kg in old.groups_with_state():
        rows = old.export_rows(kg)
        for i, key_bytes in enumerate(rows["key"]):
            new_kg = key_group_of_bytes(key_bytes, new_max_parallelism)
            target = regrouped.setdefault(new_kg, empty_rows())
            for c in ROW_COLUMNS:
                target[c].append(rows[c][i])
    backends = empty_backends(new_max_parallelism, parallelism)
    for backend in backends:
        for kg in backend.key_groups:
            if kg in regrouped:
                backend.import_rows(kg, regrouped[kg])
    return backends, before


def reshard(
    store: ObjectStore,
    layout: Layout,
    source_id: int,
    new_max_parallelism: int,
    *,
    target_id: int | None = None,
    parallelism: int | None = None,
    metadata: Mapping[str, Any] | None = None,
) -> ReshardResult:
    """Rewrite checkpoint ``source_id`` for ``new_max_parallelism`` and commit it: the
    state of every keyed step (a dataflow's further steps' too), each checked on its own.

    ``metadata``: the new manifest's (the runtime passes its batch record, marked as a
    reshard's copy); by default the source's, with ``resharded_from`` added."""
    check_max_parallelism(new_max_parallelism)
    source = load_manifest(store, layout, source_id)
    target_id = source_id + 1 if target_id is None else target_id
    parallelism = parallelism or min(source.parallelism, new_max_parallelism)

    # The first step's view is the manifest without the further steps.
    views = {"": dataclasses.replace(source, operators={})}
    views |= {uid: source.for_operator(uid) for uid in sorted(source.operators)}
    snapshots: dict[str, list[InstanceSnapshot]] = {}
    digests: dict[str, tuple[int, str]] = {}
    for uid, view in views.items():
        backends, digests[uid] = _regrouped(store, view, new_max_parallelism, parallelism)
        snapshots[uid] = [
            write_instance_run(store, layout, b, target_id, i) for i, b in enumerate(backends)
        ]
    from microbatch.runtime.faults import pause_if  # the kill-and-race tests' hook

    pause_if("during_reshard", f"reshard of checkpoint {source_id}")
    if metadata is None:
        metadata = dict(source.metadata) | {
            "resharded_from": {
                "checkpoint_id": source_id,
                "max_parallelism": source.max_parallelism,
            }
        }
    manifest = build_manifest(
        target_id,
        snapshots.pop(""),
        max_parallelism=new_max_parallelism,
        pipeline_fingerprint=source.pipeline_fingerprint,
        base=None,
        full=True,
        metadata=metadata,
        operators=snapshots,
        step_types={uid: op.process for uid, op in source.operators.items()},
        first_uid=source.first_uid,
    )
    if manifest.checkpoint_id <= source_id:
        raise CheckpointError(f"reshard target id {target_id} must be greater than {source_id}")

    for uid, (keys_before, checksum_before) in digests.items():
        view = manifest.for_operator(uid) if uid else dataclasses.replace(manifest, operators={})
        check = KeyedStateBackend(new_max_parallelism, KeyGroupRange(0, new_max_parallelism - 1))
        restore_groups(store, view, check, range(new_max_parallelism))
        keys_after, checksum_after = state_digest([check])
        if (keys_after, checksum_after) != (keys_before, checksum_before):
            step = f" step {uid!r}" if uid else ""
            raise CheckpointError(
                f"reshard of checkpoint {source_id}{step} to max_parallelism="
                f"{new_max_parallelism} changed the state: {keys_before} keys/"
                f"{checksum_before} before, {keys_after} keys/{checksum_after} after; "
                "nothing was committed"
            )
    commit_manifest(store, layout, manifest)
    return ReshardResult(source_id, manifest, *digests[""])
