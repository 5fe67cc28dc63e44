"""Writing a checkpoint: each instance writes its runs, the driver commits.

In order (a crash between any two steps leaves only garbage for GC, never a half-visible
checkpoint):

1. Each instance writes one sorted run with the keys it changed — merged with its newest
   runs when the size tiers say so — under an attempt-unique name (the state engine's
   :func:`~microbatch.state.engine.write_batch_run`; the runtime's stage 2, or
   :func:`write_instance_run` for an instance's whole state), and hands the driver an
   :class:`InstanceSnapshot`: its runs after this checkpoint (newest first) and its
   key-groups' key counts.
2. The driver concatenates the instances' runs into a :class:`Manifest`
   (:func:`build_manifest`), refusing runs or counts outside an instance's key-groups.
3. The driver creates the manifest with an exclusive create (:func:`commit_manifest`): the
   commit point. A second commit of the same id fails with "already committed"; the loser's
   runs are unreferenced and GC deletes them.

So a checkpoint costs two PUTs (a run's data and index) per instance that has something
to write plus one manifest create, whatever ``max_parallelism`` is. Format 1 (one state
file per instance with key-group byte ranges) is no longer written; its checkpoints are
read for the one-way migration (:mod:`.format1`).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from microbatch.checkpoint.layout import Layout
from microbatch.checkpoint.manifest import KeyGroupEntry, Manifest, OperatorState
from microbatch.errors import CheckpointError
from microbatch.keygroups import KeyGroupRange, key_group_range
from microbatch.state.backend import KeyedStateBackend
from microbatch.state.engine import RunRef, write_all_keys
from microbatch.storage import AlreadyExistsError, ObjectStore


@dataclasses.dataclass(frozen=True)
class InstanceSnapshot:
    """What one instance hands the driver: its runs, key counts and what it wrote.

    ``entries``, ``written`` and ``file`` are format 1's (key-group byte ranges), which
    nothing writes any more: always empty, kept so the task → driver JSON is unchanged."""

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


def write_instance_run(
    store: ObjectStore,
    layout: Layout,
    backend: KeyedStateBackend,
    checkpoint_id: int,
    index: int,
) -> InstanceSnapshot:
    """Step 1 for an instance whose backend holds its whole state (reshard, tools): all
    its keys as its one run, with the timer index, and its key counts."""
    own = backend.key_groups
    attempt = uuid.uuid4().hex[:12]
    written, loaded = write_all_keys(store, layout, backend, checkpoint_id, index, attempt)
    counts = {kg: loaded.key_count_changes.get(kg, 0) for kg in own}
    timers = {kg: loaded.processing_timer_changes.get(kg, 0) for kg in own}
    return InstanceSnapshot(
        index, own, {}, frozenset(), None, written.bytes_written, written.runs, counts, timers
    )


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

    ``operators``: the snapshots of a dataflow's further keyed steps, by uid, checked the
    same way; ``step_types``: their functions' classes; ``first_uid``: the uid of the step
    ``snapshots`` are of."""
    parallelism = len(snapshots)
    if base is not None and checkpoint_id <= base.checkpoint_id:
        raise CheckpointError(
            f"checkpoint id {checkpoint_id} must be greater than its base {base.checkpoint_id}"
        )
    without_runs = sorted(s.index for s in snapshots if s.runs is None)
    if without_runs:
        raise CheckpointError(
            f"checkpoint {checkpoint_id}: instance(s) {without_runs} returned no sorted runs; "
            "checkpoints are written as sorted runs only (format 1 is read, never written): "
            "write each instance with write_instance_run or the state engine"
        )
    for snap in sorted(snapshots, key=lambda s: s.index):
        expected = key_group_range(max_parallelism, parallelism, snap.index)
        covered = set(snap.key_counts or ())
        if snap.key_groups != expected or covered != set(expected):
            raise CheckpointError(
                f"checkpoint {checkpoint_id}: instance {snap.index} of {parallelism} covers "
                f"{snap.key_groups}, expected {expected}"
            )
    if sorted(s.index for s in snapshots) != list(range(parallelism)):
        raise CheckpointError(f"checkpoint {checkpoint_id}: instances are not 0..{parallelism - 1}")
    runs, counts = _merged_runs(checkpoint_id, snapshots, max_parallelism)
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
        key_groups=(None,) * max_parallelism,
        full_checkpoint_id=checkpoint_id if full or base is None else base.full_checkpoint_id,
        created_at=dt.datetime.now(dt.UTC).isoformat(timespec="milliseconds"),
        metadata=dict(metadata or {}),
        runs=tuple(runs),
        key_counts=tuple(counts),
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
) -> Manifest:
    """Steps 1-3 in one process for instances ``0..len(backends)-1`` whose backends hold
    their whole state (tests, tools): expired TTL entries pruned, each instance's state
    written as its one run — a full checkpoint; ``base`` only orders the ids."""
    if not backends:
        raise CheckpointError(f"checkpoint {checkpoint_id}: no instance backends given")
    snaps = []
    for i, backend in enumerate(backends):
        backend.prune_expired()
        snaps.append(write_instance_run(store, layout, backend, checkpoint_id, i))
    manifest = build_manifest(
        checkpoint_id,
        snaps,
        max_parallelism=backends[0].max_parallelism,
        pipeline_fingerprint=pipeline_fingerprint,
        base=base,
        full=True,
        metadata=metadata,
    )
    commit_manifest(store, layout, manifest)
    for backend in backends:  # everything is in the checkpoint now
        backend.dirty.clear()
        backend.dirty_keys = set()
    return manifest
