"""Restoring one operator instance, at any parallelism, from a manifest.

Instance ``i`` of ``P'`` owns ``key_group_range(maxP, P', i)`` — whatever parallelism the
checkpoint was written at. It reads only its key-groups' byte ranges: the ranges are
grouped by file, sorted by offset, and neighbours closer than ``max_gap`` bytes are
coalesced into one ranged GET (``max_gap=0``: only exactly adjacent ranges). After a
rescale from ``P`` to ``P'`` an instance's key-groups were written contiguously by at most
a few old instances, so this is typically one GET per file it touches.

A manifest of sorted runs is read through its runs instead: every key of the instance's
key-groups, from the blocks that overlap them (:func:`~microbatch.checkpoint.runstate.
load_range`). The runtime never restores an instance whole any more — a batch loads only
the keys it touches — so this serves tools, tests and the migration of format 1.

Every byte range is checked against the manifest's CRC-32 before it is decoded; a missing
file, a short read or a mismatch is a :class:`CheckpointError` naming the checkpoint, the
file and the key-group — never an empty state.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable

from microbatch.checkpoint.manifest import KeyGroupEntry, Manifest
from microbatch.checkpoint.runstate import instance_runs, load_range
from microbatch.checkpoint.statefile import decode_segment
from microbatch.errors import CheckpointError
from microbatch.keygroups import KeyGroupRange, key_group_range
from microbatch.state.backend import KeyedStateBackend, Rows
from microbatch.state.blockcache import BlockCache
from microbatch.storage import ObjectNotFoundError, ObjectStore


@dataclasses.dataclass(frozen=True)
class RangeRead:
    """One ranged GET: ``length`` bytes of ``file`` from ``offset``, covering ``groups``."""

    file: str
    offset: int
    length: int
    groups: tuple[tuple[int, KeyGroupEntry], ...]


@dataclasses.dataclass(frozen=True)
class RestoreStats:
    """What a restore cost: requests made and bytes read (incl. coalescing gaps)."""

    requests: int
    bytes_read: int
    key_groups: int
    own_bytes: int


def plan_reads(manifest: Manifest, key_groups: Iterable[int], max_gap: int = 0) -> list[RangeRead]:
    """The ranged GETs that fetch ``key_groups`` of ``manifest``, coalesced per file."""
    by_file: dict[str, list[tuple[int, KeyGroupEntry]]] = {}
    for kg in key_groups:
        entry = manifest.key_groups[kg]
        if entry is not None:
            by_file.setdefault(entry.file, []).append((kg, entry))
    reads = []
    for file, items in sorted(by_file.items()):
        items.sort(key=lambda item: item[1].offset)
        group = [items[0]]
        for item in items[1:]:
            last = group[-1][1]
            if item[1].offset - (last.offset + last.length) <= max_gap:
                group.append(item)
            else:
                reads.append(_read(file, group))
                group = [item]
        reads.append(_read(file, group))
    return reads


def _read(file: str, group: list[tuple[int, KeyGroupEntry]]) -> RangeRead:
    start = group[0][1].offset
    end = max(e.offset + e.length for _, e in group)
    return RangeRead(file, start, end - start, tuple(group))


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
    """Load ``key_groups`` of ``manifest`` into ``backend``; return what it cost."""
    if manifest.runs is not None:
        return _restore_from_runs(store, manifest, backend, key_groups)
    reads = plan_reads(manifest, key_groups, max_gap)
    nbytes = own = groups = 0
    for read in reads:
        data = _fetch(store, manifest, read)
        nbytes += len(data)
        for kg, entry in read.groups:
            where = (
                f"checkpoint {manifest.checkpoint_id}, file {store.url}/{entry.file}, "
                f"key-group {kg}"
            )
            start = entry.offset - read.offset
            rows: Rows = decode_segment(data[start : start + entry.length], entry.crc32, where)
            backend.import_rows(kg, rows)
            own += entry.length
            groups += 1
    return RestoreStats(len(reads), nbytes, groups, own)


def _restore_from_runs(
    store: ObjectStore, manifest: Manifest, backend: KeyedStateBackend, key_groups: Iterable[int]
) -> RestoreStats:
    cache = BlockCache(store)
    groups = sorted(set(key_groups))
    spans: list[list[int]] = []
    for kg in groups:  # contiguous stretches, one scan each
        if spans and kg == spans[-1][1] + 1:
            spans[-1][1] = kg
        else:
            spans.append([kg, kg])
    for first, last in spans:
        runs = instance_runs(manifest, KeyGroupRange(first, last))
        load_range(cache, runs, backend, first, last)
    fetched = cache.stats.bytes_fetched
    return RestoreStats(cache.stats.requests, fetched, len(groups), fetched)


def _fetch(store: ObjectStore, manifest: Manifest, read: RangeRead) -> bytes:
    kgs = ", ".join(str(kg) for kg, _ in read.groups)
    where = f"checkpoint {manifest.checkpoint_id}, file {store.url}/{read.file}, key-group(s) {kgs}"
    try:
        data = store.get_range(read.file, read.offset, read.length)
    except ObjectNotFoundError:
        raise CheckpointError(f"{where}: the state file is missing") from None
    if len(data) != read.length:
        raise CheckpointError(
            f"{where}: the state file is truncated (read {len(data)} of {read.length} bytes "
            f"at offset {read.offset})"
        )
    return data


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


def single_group_range(kg: int) -> KeyGroupRange:
    return KeyGroupRange(kg, kg)
