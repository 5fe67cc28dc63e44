"""Restoring one operator instance, at any parallelism, from a manifest.

Instance ``i`` of ``P'`` owns ``key_group_range(maxP, P', i)`` — whatever parallelism the
checkpoint was written at — and reads only its key-groups: from a manifest of sorted runs,
the blocks of the runs serving them (the state engine's
:func:`~microbatch.state.engine.load_key_groups`); from a format-1 manifest, their byte ranges
(:mod:`.format1`). The runtime never restores an instance whole any more — a batch loads
only the keys it touches — so this serves tools, tests, reshard and the migration of
format 1.

A missing object, a short read or a checksum mismatch is a :class:`CheckpointError`
naming the checkpoint, the object and the key-group or block — never an empty state.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable

from microbatch.checkpoint.format1 import load_files
from microbatch.checkpoint.manifest import Manifest
from microbatch.errors import CheckpointError
from microbatch.keygroups import KeyGroupRange, key_group_range
from microbatch.state.backend import KeyedStateBackend
from microbatch.state.engine import RunRef, clip_runs, load_key_groups
from microbatch.storage import ObjectStore


@dataclasses.dataclass(frozen=True)
class RestoreStats:
    """What a restore cost: requests made and bytes read (incl. coalescing gaps)."""

    requests: int
    bytes_read: int
    key_groups: int
    own_bytes: int


def instance_runs(manifest: Manifest | None, own: KeyGroupRange) -> list[RunRef]:
    """The runs of ``manifest`` that serve key-groups of ``own``, clipped to them, newest
    first (none for a format-1 manifest or no manifest)."""
    return clip_runs(None if manifest is None else manifest.runs, own)


def check_restore_parallelism(manifest: Manifest, parallelism: int) -> None:
    if not isinstance(parallelism, int) or parallelism < 1:
        raise CheckpointError(f"restore parallelism must be an int >= 1: {parallelism!r}")
    if parallelism > manifest.max_parallelism:
        raise CheckpointError(
            f"cannot restore checkpoint {manifest.checkpoint_id} at parallelism {parallelism}: "
            f"it has max_parallelism={manifest.max_parallelism} key-groups and each instance "
            "needs at least one. Lower the parallelism, or reshard to a larger max_parallelism."
        )


def restore_groups(
    store: ObjectStore,
    manifest: Manifest,
    backend: KeyedStateBackend,
    key_groups: Iterable[int],
    *,
    max_gap: int = 0,
) -> RestoreStats:
    """Load ``key_groups`` of ``manifest`` into ``backend``; return what it cost
    (``max_gap``: format 1's coalescing of byte ranges)."""
    if manifest.runs is None:
        return RestoreStats(*load_files(store, manifest, backend, key_groups, max_gap))
    groups = set(key_groups)
    cost = load_key_groups(store, manifest.runs, backend, groups)
    return RestoreStats(cost.requests, cost.bytes_fetched, len(groups), cost.bytes_fetched)


def restore_instance(
    store: ObjectStore,
    manifest: Manifest,
    parallelism: int,
    index: int,
    *,
    clock: Callable[[], float] = time.time,
    max_gap: int = 0,
) -> tuple[KeyedStateBackend, RestoreStats]:
    """A backend for instance ``index`` of ``parallelism`` holding exactly its state."""
    check_restore_parallelism(manifest, parallelism)
    own = key_group_range(manifest.max_parallelism, parallelism, index)
    backend = KeyedStateBackend(manifest.max_parallelism, own, clock=clock)
    stats = restore_groups(store, manifest, backend, own, max_gap=max_gap)
    return backend, stats


def empty_backends(
    max_parallelism: int, parallelism: int, clock: Callable[[], float] = time.time
) -> list[KeyedStateBackend]:
    """Fresh backends for a first run (no checkpoint yet)."""
    return [
        KeyedStateBackend(
            max_parallelism, key_group_range(max_parallelism, parallelism, i), clock=clock
        )
        for i in range(parallelism)
    ]
