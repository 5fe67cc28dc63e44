"""Writing a checkpoint: each instance writes its state objects, the driver commits.

With sorted runs (what the runtime writes, :mod:`microbatch.checkpoint.runstate`) step 1
is one run per instance with the keys it changed, and the snapshot carries the instance's
runs (newest first) and its key-groups' key counts instead of key-group entries; steps 2-4
are the same. The protocol of one state file per instance (format 1), in order (a crash
between any two steps leaves only garbage for GC, never a half-visible checkpoint):

1. Each instance prunes expired TTL entries, then encodes the key-groups it must write —
   all of them on a full checkpoint, otherwise only the changed ("dirty") ones — into
   **one** state file and PUTs it under a fresh attempt name (:func:`write_instance`).
   Unchanged key-groups keep their entry from the base manifest.
2. The driver merges the instances' entries into a :class:`Manifest` (:func:`build_manifest`).
3. The driver creates the manifest with an exclusive create (:func:`commit_manifest`): the
   commit point. A second commit of the same id fails with "already committed"; the loser's
   state files are unreferenced and GC deletes them.
4. After the commit, each instance forgets its dirty set (:meth:`InstanceSnapshot.acknowledge`).

So a checkpoint costs one PUT per instance that has something to write plus one manifest
create, whatever ``max_parallelism`` is.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from microbatch.checkpoint.layout import Layout
from microbatch.checkpoint.manifest import KeyGroupEntry, Manifest, OperatorState
from microbatch.checkpoint.statefile import encode_state_file
from microbatch.errors import CheckpointError
from microbatch.keygroups import KeyGroupRange, key_group_range
from microbatch.state.backend import KeyedStateBackend
from microbatch.state.blockcache import RunRef
from microbatch.storage import AlreadyExistsError, ObjectStore

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class InstanceSnapshot:
    """What one instance hands the driver: its key-groups' entries and what it wrote."""

    index: int
    key_groups: KeyGroupRange
    entries: Mapping[int, KeyGroupEntry | None]
    written: frozenset[int]
    file: str | None
    bytes_written: int
    #: Sorted runs: the instance's runs after this checkpoint, newest first.
    runs: tuple[RunRef, ...] | None = None
    #: Sorted runs: keys with state per key-group of the instance.
    key_counts: Mapping[int, int] | None = None
    #: Sorted runs: processing-time timers per key-group of the instance (None: none).
    processing_timer_counts: Mapping[int, int] | None = None

    def acknowledge(self, backend: KeyedStateBackend) -> None:
        """Step 4: after the commit, the written key-groups are clean again."""
        backend.dirty.difference_update(self.written)
        backend.dirty_keys = {k for k in backend.dirty_keys if k[0] not in self.written}

    def to_json(self) -> dict[str, Any]:
        """JSON-ready, for the trip from a Spark task to the driver."""
        return {
            "index": self.index,
            "key_groups": [self.key_groups.start, self.key_groups.end],
            "entries": {
                str(kg): None if e is None else dataclasses.asdict(e)
                for kg, e in self.entries.items()
            },
            "written": sorted(self.written),
            "file": self.file,
            "bytes_written": self.bytes_written,
            "runs": None if self.runs is None else [r.to_json() for r in self.runs],
            "key_counts": None
            if self.key_counts is None
            else {str(kg): n for kg, n in self.key_counts.items()},
            "processing_timer_counts": None
            if self.processing_timer_counts is None
            else {str(kg): n for kg, n in self.processing_timer_counts.items()},
        }

    @classmethod
    def from_json(cls, body: Mapping[str, Any]) -> InstanceSnapshot:
        return cls(
            index=body["index"],
            key_groups=KeyGroupRange(*body["key_groups"]),
            entries={
                int(kg): None if e is None else KeyGroupEntry(**e)
                for kg, e in body["entries"].items()
            },
            written=frozenset(body["written"]),
            file=body["file"],
            bytes_written=body["bytes_written"],
            runs=None if body.get("runs") is None else tuple(map(RunRef.from_json, body["runs"])),
            key_counts=None
            if body.get("key_counts") is None
            else {int(kg): n for kg, n in body["key_counts"].items()},
            processing_timer_counts=None
            if body.get("processing_timer_counts") is None
            else {int(kg): n for kg, n in body["processing_timer_counts"].items()},
        )


def should_write_full(base: Manifest | None, checkpoint_id: int, full_every: int) -> bool:
    """A full rewrite when there is no base, or ``full_every`` checkpoints since the last.

    ``full_every = 0`` never forces one (the chain of files then grows unboundedly).
    """
    if base is None:
        return True
    return full_every > 0 and checkpoint_id - base.full_checkpoint_id >= full_every


def write_instance(
    store: ObjectStore,
    layout: Layout,
    backend: KeyedStateBackend,
    checkpoint_id: int,
    index: int,
    base: Manifest | None,
    *,
    full: bool,
) -> InstanceSnapshot:
    """Step 1 for one instance: one state file with its full or changed key-groups."""
    if base is not None and base.max_parallelism != backend.max_parallelism:
        raise CheckpointError(
            f"checkpoint {checkpoint_id}: backend max_parallelism {backend.max_parallelism} "
            f"differs from base checkpoint {base.checkpoint_id} ({base.max_parallelism})"
        )
    backend.prune_expired()
    own = backend.key_groups
    rewrite_all = full or base is None
    to_write = [kg for kg in own if rewrite_all or kg in backend.dirty]
    groups = {kg: backend.export_rows(kg) for kg in to_write}
    groups = {kg: rows for kg, rows in groups.items() if rows["key"]}

    file_key, nbytes = None, 0
    entries: dict[int, KeyGroupEntry | None] = {}
    if groups:
        data, segments = encode_state_file(groups)
        file_key = layout.state_key(checkpoint_id, index)
        store.put(file_key, data)
        nbytes = len(data)
        for kg, seg in segments.items():
            entries[kg] = KeyGroupEntry(
                file_key, seg.offset, seg.length, seg.crc32, seg.rows, seg.keys, checkpoint_id
            )
    for kg in own:
        if kg not in entries:
            # Rewritten but empty (cleared or expired) → None; unchanged → the base entry.
            carried = not rewrite_all and kg not in backend.dirty and base is not None
            entries[kg] = base.key_groups[kg] if carried else None
    log.debug(
        "checkpoint %s instance %s: wrote %d key-groups, %d bytes",
        checkpoint_id,
        index,
        len(groups),
        nbytes,
    )
    return InstanceSnapshot(index, own, entries, frozenset(to_write), file_key, nbytes)


def build_manifest(
    checkpoint_id: int,
    snapshots: Sequence[InstanceSnapshot],
    *,
    max_parallelism: int,
    pipeline_fingerprint: str,
    base: Manifest | None,
    full: bool,
    metadata: Mapping[str, Any] | None = None,
    operators: Mapping[str, Sequence[InstanceSnapshot]] | None = None,
    step_types: Mapping[str, str] | None = None,
    first_uid: str | None = None,
) -> Manifest:
    """Step 2: merge instance snapshots; every key-group must be covered exactly once.

    ``operators``: the snapshots of a dataflow's further keyed steps, by uid (sorted
    runs only), checked the same way; ``step_types``: their functions' classes;
    ``first_uid``: the uid of the step ``snapshots`` are of."""
    parallelism = len(snapshots)
    if base is not None and checkpoint_id <= base.checkpoint_id:
        raise CheckpointError(
            f"checkpoint id {checkpoint_id} must be greater than its base {base.checkpoint_id}"
        )
    entries: list[KeyGroupEntry | None] = [None] * max_parallelism
    as_runs = any(s.runs is not None for s in snapshots)
    for snap in sorted(snapshots, key=lambda s: s.index):
        expected = key_group_range(max_parallelism, parallelism, snap.index)
        covered = set(snap.key_counts or ()) if as_runs else set(snap.entries)
        if snap.key_groups != expected or covered != set(expected):
            raise CheckpointError(
                f"checkpoint {checkpoint_id}: instance {snap.index} of {parallelism} covers "
                f"{snap.key_groups}, expected {expected}"
            )
        for kg, entry in snap.entries.items():
            entries[kg] = entry
    if sorted(s.index for s in snapshots) != list(range(parallelism)):
        raise CheckpointError(f"checkpoint {checkpoint_id}: instances are not 0..{parallelism - 1}")
    runs, counts = _merged_runs(checkpoint_id, snapshots, max_parallelism) if as_runs else ((), ())
    types = step_types or {}
    steps = {}
    for uid, snaps in (operators or {}).items():
        runs_of, counts_of = _merged_runs(checkpoint_id, snaps, max_parallelism, uid)
        steps[uid] = OperatorState(
            runs_of,
            counts_of,
            types.get(uid, ""),
            processing_timer_counts(snaps, max_parallelism),
        )
    return Manifest(
        checkpoint_id=checkpoint_id,
        pipeline_fingerprint=pipeline_fingerprint,
        max_parallelism=max_parallelism,
        parallelism=parallelism,
        key_groups=tuple(entries),
        full_checkpoint_id=checkpoint_id if full or base is None else base.full_checkpoint_id,
        created_at=dt.datetime.now(dt.UTC).isoformat(timespec="milliseconds"),
        metadata=dict(metadata or {}),
        runs=tuple(runs) if as_runs else None,
        key_counts=tuple(counts) if as_runs else None,
        operators=steps,
        first_uid=first_uid,
        processing_timer_counts=processing_timer_counts(snapshots, max_parallelism),
    )


def processing_timer_counts(
    snapshots: Sequence[InstanceSnapshot], max_parallelism: int
) -> tuple[int, ...] | None:
    """Processing-time timers per key-group, None when there are none: a batch scans the
    processing-time timer index of only the key-groups that have some."""
    counts = [0] * max_parallelism
    for snap in snapshots:
        for kg, n in (snap.processing_timer_counts or {}).items():
            counts[kg] = n
    return tuple(counts) if any(counts) else None


def _merged_runs(
    checkpoint_id: int,
    snapshots: Sequence[InstanceSnapshot],
    max_parallelism: int,
    uid: str | None = None,
) -> tuple[tuple[RunRef, ...], tuple[int, ...]]:
    """The instances' runs, one stretch per instance, and the key counts per key-group;
    refused when an instance's runs or counts stray outside its key-groups."""
    parallelism = len(snapshots)
    what = "" if uid is None else f" step {uid!r}"
    if sorted(s.index for s in snapshots) != list(range(parallelism)):
        raise CheckpointError(
            f"checkpoint {checkpoint_id}{what}: instances are not 0..{parallelism - 1}"
        )
    runs: list[RunRef] = []
    counts = [0] * max_parallelism
    for snap in sorted(snapshots, key=lambda s: s.index):
        expected = key_group_range(max_parallelism, parallelism, snap.index)
        outside = [r for r in snap.runs or () if r.clipped(expected.start, expected.end) != r]
        if snap.runs is None or outside or set(snap.key_counts or ()) != set(expected):
            raise CheckpointError(
                f"checkpoint {checkpoint_id}{what}: instance {snap.index} of {parallelism} "
                f"returned runs or key counts outside its key-groups {expected}: "
                f"{outside or 'none'}"
            )
        runs += snap.runs  # each instance's stretch: newest first within its range
        for kg, n in (snap.key_counts or {}).items():
            counts[kg] = n
    return tuple(runs), tuple(counts)


def commit_manifest(store: ObjectStore, layout: Layout, manifest: Manifest) -> None:
    """Step 3: the commit point — exclusive create of the manifest.

    The caller tests first that the id comes right after the newest checkpoint. An
    attempt frozen between that test and this create, while other runs commit past the id
    and retention removes it, still creates it: an orphan below the retention floor, which
    every reader ignores and the next GC deletes (:mod:`.catalog`)."""
    key = layout.manifest_key(manifest.checkpoint_id)
    try:
        store.create(key, manifest.to_json())
    except AlreadyExistsError:
        raise CheckpointError(
            f"checkpoint {manifest.checkpoint_id} is already committed ({store.url}/{key}): "
            "another writer won; this attempt's state files are left for GC"
        ) from None


def checkpoint(
    store: ObjectStore,
    layout: Layout,
    backends: Sequence[KeyedStateBackend],
    checkpoint_id: int,
    *,
    base: Manifest | None,
    pipeline_fingerprint: str,
    metadata: Mapping[str, Any] | None = None,
    full_every: int = 10,
) -> Manifest:
    """Steps 1-4 in one process, for instances ``0..len(backends)-1`` (tests, tools)."""
    if not backends:
        raise CheckpointError(f"checkpoint {checkpoint_id}: no instance backends given")
    full = should_write_full(base, checkpoint_id, full_every)
    maxp = backends[0].max_parallelism
    snaps = [
        write_instance(store, layout, b, checkpoint_id, i, base, full=full)
        for i, b in enumerate(backends)
    ]
    manifest = build_manifest(
        checkpoint_id,
        snaps,
        max_parallelism=maxp,
        pipeline_fingerprint=pipeline_fingerprint,
        base=base,
        full=full,
        metadata=metadata,
    )
    commit_manifest(store, layout, manifest)
    for snap, backend in zip(snaps, backends, strict=True):
        snap.acknowledge(backend)
    return manifest
