"""One instance's keyed state kept in sorted runs: load what a batch touches, write what
it changed.

An instance starts a batch with an empty :class:`~microbatch.state.KeyedStateBackend`
and the runs its base checkpoint names for its key-groups (newest first). It loads

- the keys of the batch's records (:func:`load_keys`, one bulk lookup), and
- the keys with timers due by the batch's watermark (:func:`load_due_timers`, one range
  read of the timer index per key-group),

processes them exactly as before, and writes one new run (:func:`write_changes`): the
whole state of every key it changed, a deletion for a key left without state, and the
timer-index entries that changed. The cost of a batch follows the keys it touches; the
state it does not touch is never read. See :mod:`microbatch.state.engine.bundle` for the entries.

When the size tiers say so (:mod:`microbatch.state.engine.compaction`), the batch's changes are
merged with the newest runs of the instance's range into one run instead
(:func:`write_batch_run`): the next manifest names the merged run in their place, and the
runs it replaced stay for the retained checkpoints that still name them, until GC.

A manifest's runs serve every key-group newest first; :func:`clip_runs` gives an
instance at any parallelism the runs overlapping its key-groups, clipped to them.

Where a run is stored is the caller's: :class:`RunNames` (the checkpoint's
:class:`~microbatch.checkpoint.Layout` is one) — the engine knows runs, not checkpoints.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator, Sequence
from operator import itemgetter
from typing import Protocol

import pyarrow as pa

from microbatch.keygroups import KeyGroupRange, key_group_of_bytes
from microbatch.state.backend import KeyedStateBackend
from microbatch.state.engine.blockcache import BlockCache, CacheStats, RunRef, lookup, scan
from microbatch.state.engine.bundle import (
    PROCESSING_TIMER,
    STATE,
    TIMER,
    decode_bundle,
    encode_bundle,
    parse_timer_key,
    state_key,
    timer_key,
    timers_until,
    value_bundles,
)
from microbatch.state.engine.compaction import runs_to_merge
from microbatch.state.engine.runs import Entry, composite, encode_run, merge, split
from microbatch.state.timers import NO_STAMPS
from microbatch.storage import ObjectStore

#: Blocks fetched at a time while a merge streams through a run.
MERGE_CHUNK = 256


class RunNames(Protocol):
    """Names the object of an instance's state for a batch (``.arrow`` suffixed); the
    engine derives the run's data and index names from it."""

    def state_key(self, checkpoint_id: int, instance: int, attempt: str | None = None) -> str: ...


@dataclasses.dataclass
class Loaded:
    """What was loaded into the backend: each key's timers as they were (the write
    compares against them), and how many keys had state."""

    timers: dict[tuple[int, bytes], frozenset[int]] = dataclasses.field(default_factory=dict)
    #: Each loaded key's processing-time timers as they were.
    processing_timers: dict[tuple[int, bytes], frozenset[int]] = dataclasses.field(
        default_factory=dict
    )
    keys_found: int = 0
    #: The loaded keys that had state (for the key counts).
    found: set[tuple[int, bytes]] = dataclasses.field(default_factory=set)
    #: Key-group → keys with state gained (+) or lost (-), filled by changed_entries.
    key_count_changes: dict[int, int] = dataclasses.field(default_factory=dict)
    #: Key-group → processing-time timers gained (+) or lost (-), likewise.
    processing_timer_changes: dict[int, int] = dataclasses.field(default_factory=dict)


def load_keys(
    cache: BlockCache,
    runs: Sequence[RunRef],
    backend: KeyedStateBackend,
    keys: Iterable[bytes],
    loaded: Loaded,
) -> None:
    """Bring the state of ``keys`` (canonical key bytes of this instance's key-groups)
    into ``backend``; keys already loaded are skipped. A key found in no run has no state
    and no timers: it is only marked loaded (a first batch's keys, most keys of a join)."""
    maxp, known = backend.max_parallelism, loaded.timers
    new = [pair for kb in keys if (pair := (key_group_of_bytes(kb, maxp), kb)) not in known]
    known.update(dict.fromkeys(new, NO_STAMPS))
    loaded.processing_timers.update(dict.fromkeys(new, NO_STAMPS))
    if not runs:
        return
    wanted = {state_key(kg, kb): (kg, kb) for kg, kb in new}
    found = lookup(cache, runs, wanted)
    for sort_key in sorted(found):
        value = found[sort_key]
        if value is None:  # deleted
            continue
        kg, kb = wanted[sort_key]
        rows = decode_bundle(value, f"run entry of key {kb!r} (key-group {kg})")
        backend.import_key(kg, kb, rows)
        loaded.keys_found += 1
        loaded.found.add((kg, kb))
        known[kg, kb] = backend.timers.stamps(kg, kb)
        loaded.processing_timers[kg, kb] = backend.processing_timers.stamps(kg, kb)


def load_due_timers(
    cache: BlockCache,
    runs: Sequence[RunRef],
    backend: KeyedStateBackend,
    watermark: int,
    loaded: Loaded,
    kind: bytes = TIMER,
    key_groups: Iterable[int] | None = None,
) -> int:
    """Load every key of this instance with a timer due by ``watermark`` (``kind``
    :data:`PROCESSING_TIMER`: by a processing time; ``key_groups``: only those of its
    key-groups); returns how many timers are due."""
    due = []
    for kg in backend.key_groups if key_groups is None else key_groups:
        lo, hi = timers_until(kg, watermark, kind)
        due += [parse_timer_key(k) for k, _ in scan(cache, runs, lo, hi)]
    load_keys(cache, runs, backend, {kb for _, _, kb in due}, loaded)
    return len(due)


def mark_all_changed(backend: KeyedStateBackend) -> None:
    """Mark every key the backend holds as changed, so the next run carries the whole
    state (a format-1 checkpoint's migration, a reshard's new checkpoint). With a fresh
    :class:`Loaded`, each such key also counts as a key gained."""
    backend.dirty_keys = {(kg, kb) for kg in backend.key_groups for kb in backend.keys([kg])}


def changed_entries(backend: KeyedStateBackend, loaded: Loaded) -> list[Entry]:
    """The run entries for every key the batch changed, in sort-key order. A key loaded
    without state that has none now gets no entry (no deletion of nothing); a changed key
    that was never loaded always gets one."""
    out = _value_entries(backend, loaded)
    if out is None:
        out = _entries_per_key(backend, loaded)
    out.sort(key=itemgetter(0))
    return out


def _value_entries(backend: KeyedStateBackend, loaded: Loaded) -> list[Entry] | None:
    """:func:`_entries_per_key` for the common case of many keys — one value state and no
    timers, before or after (a table join's table, a running total) — from each key's
    stored value, without exporting its rows one key at a time: the same entries.
    None when the state is not of that shape."""
    if len(backend.kinds) != 1 or backend.timers or backend.processing_timers:
        return None
    [(name, kind)] = backend.kinds.items()
    if kind != "value" or any(loaded.timers.values()) or any(loaded.processing_timers.values()):
        return None
    dirty = list(backend.dirty_keys)
    tables = {kg: group.get(name, {}) for kg, group in backend.groups.items()}
    stored = [tables.get(kg, {}).get(kb) for kg, kb in dirty]
    bundles = iter(value_bundles(name, [s for s in stored if s is not None]))
    found, known, changes = loaded.found, loaded.timers, loaded.key_count_changes
    prefix = {kg: state_key(kg, b"") for kg in backend.key_groups}  # sort key: prefix + key
    out: list[Entry] = []
    for (kg, kb), held in zip(dirty, stored, strict=True):
        had = (kg, kb) in found
        if held is not None:
            out.append((prefix[kg] + kb, next(bundles)))
        elif had or (kg, kb) not in known:
            out.append((prefix[kg] + kb, None))
        if had != (held is not None):
            changes[kg] = changes.get(kg, 0) + (-1 if had else 1)
    return out


def _entries_per_key(backend: KeyedStateBackend, loaded: Loaded) -> list[Entry]:
    """The entries of :func:`changed_entries`, unsorted, from each key's exported rows."""
    out: list[Entry] = []
    changes = loaded.key_count_changes
    for kg, kb in backend.dirty_keys:
        bundle = encode_bundle(backend.export_key(kg, kb))
        had = (kg, kb) in loaded.found
        if bundle is not None or had or (kg, kb) not in loaded.timers:
            out.append((state_key(kg, kb), bundle))
        if had != (bundle is not None):
            changes[kg] = changes.get(kg, 0) + (-1 if had else 1)
        now = backend.timers.stamps(kg, kb)
        before = loaded.timers.get((kg, kb), NO_STAMPS)
        if now != before:  # most keys: no timers before or after, or the same ones
            out += [(timer_key(kg, ts, kb), b"") for ts in now - before]
            out += [(timer_key(kg, ts, kb), None) for ts in before - now]
        now = backend.processing_timers.stamps(kg, kb)
        before = loaded.processing_timers.get((kg, kb), NO_STAMPS)
        if now != before:
            out += [(timer_key(kg, ts, kb, PROCESSING_TIMER), b"") for ts in now - before]
            out += [(timer_key(kg, ts, kb, PROCESSING_TIMER), None) for ts in before - now]
            ptc = loaded.processing_timer_changes
            ptc[kg] = ptc.get(kg, 0) + len(now - before) - len(before - now)
    return out


def run_keys(layout: RunNames, batch_id: int, instance: int, attempt: str) -> tuple[str, str]:
    """The data and index objects of one instance's run of a batch (attempt-unique, so a
    zombie never overwrites a run a manifest names)."""
    stem = layout.state_key(batch_id, instance, attempt).removesuffix(".arrow")
    return f"{stem}.run.arrow", f"{stem}.index.arrow"


def write_changes(
    store: ObjectStore,
    layout: RunNames,
    entries: Sequence[Entry],
    batch_id: int,
    instance: int,
    attempt: str,
    key_groups: KeyGroupRange,
) -> RunRef | None:
    """Write ``entries`` as this instance's run of the batch; None when nothing changed."""
    if not entries:
        return None
    data, index = encode_run(entries)
    data_key, index_key = run_keys(layout, batch_id, instance, attempt)
    store.put(data_key, data)
    store.put(index_key, index.to_bytes())
    return RunRef(data_key, index_key, key_groups.start, key_groups.end)


def clip_runs(runs: Sequence[RunRef] | None, own: KeyGroupRange) -> list[RunRef]:
    """The ``runs`` (a manifest's, newest first per key-group) that serve key-groups of
    ``own``, clipped to them: an instance's view at any parallelism (the rest of each run
    is never read)."""
    if runs is None or own.is_empty:
        return []
    clipped = (ref.clipped(own.start, own.end) for ref in runs)
    return [ref for ref in clipped if ref is not None]


def size_in_range(cache: BlockCache, ref: RunRef) -> int:
    """Bytes of the blocks of ``ref`` within the key-groups it serves (from its index)."""
    index = cache.index(ref)
    return sum(index.blocks[n].length for n in index.blocks_in_range(ref.kg_first, ref.kg_last))


def iter_entries(cache: BlockCache, ref: RunRef) -> Iterator[Entry]:
    """Every entry of ``ref`` in the key-groups it serves, deletions included, in order —
    a chunk of blocks at a time, so a merge holds one chunk of each run in memory."""
    index = cache.index(ref)
    lo, hi = composite(ref.kg_first, b""), composite(ref.kg_last + 1, b"")
    numbers = index.blocks_between(lo, hi)
    for start in range(numbers.start, numbers.stop, MERGE_CHUNK):
        chunk = range(start, min(start + MERGE_CHUNK, numbers.stop))
        batches = cache.batches(ref, chunk, keep=False)
        for n in chunk:
            batch = batches[n]
            kgs = batch.column(0).to_pylist()
            keys = batch.column(1).to_pylist()
            values = batch.column(2).to_pylist()
            for kg, k, v in zip(kgs, keys, values, strict=True):
                sort_key = composite(kg, k)
                if lo <= sort_key < hi:
                    yield sort_key, v


@dataclasses.dataclass(frozen=True)
class Written:
    """What an instance's checkpoint wrote: its runs for the next manifest (newest first),
    the bytes it uploaded, and how many older runs a merge replaced."""

    runs: tuple[RunRef, ...]
    bytes_written: int
    merged: int


def write_batch_run(
    store: ObjectStore,
    layout: RunNames,
    cache: BlockCache,
    view: Sequence[RunRef],
    entries: Sequence[Entry],
    batch_id: int,
    instance: int,
    attempt: str,
    key_groups: KeyGroupRange,
) -> Written:
    """The batch's changes as one new run in front of ``view`` — or, when the size tiers
    say so, merged with the newest runs of ``view`` into that one run (each byte is then
    rewritten about once per tier). A batch without changes writes and merges nothing."""
    if not entries:
        return Written(tuple(view), 0, 0)
    plain: list[pa.RecordBatch] | None = []  # the batch's blocks, for the local cache
    data, index = encode_run(entries, plain=plain)
    take = runs_to_merge([len(data), *(size_in_range(cache, r) for r in view)]) - 1
    if take > 0:
        older = view[:take]
        streams = [iter(entries), *(iter_entries(cache, r) for r in older)]
        merged = merge(streams, keep_deletions=take < len(view))
        data, index = encode_run(merged)
        plain = None  # a merge may be large: keep_run decodes its blocks one at a time
    else:
        take = 0
    rest = tuple(view[take:])
    if not index.blocks:  # everything merged away was a deletion
        return Written(rest, 0, take)
    data_key, index_key = run_keys(layout, batch_id, instance, attempt)
    index_bytes = index.to_bytes()
    store.put(data_key, data)
    store.put(index_key, index_bytes)
    ref = RunRef(data_key, index_key, key_groups.start, key_groups.end, len(data))
    cache.keep_run(ref, data, index_bytes, plain)  # the next batch here reads it locally
    return Written((ref, *rest), len(data) + len(index_bytes), take)


def load_range(
    cache: BlockCache,
    runs: Sequence[RunRef],
    backend: KeyedStateBackend,
    kg_first: int,
    kg_last: int,
) -> int:
    """Load every key of key-groups ``kg_first..kg_last`` (tools: inspection, reshard,
    whole-state checks — a batch never does this); returns how many keys."""
    n = 0
    for sort_key, value in scan(cache, runs, composite(kg_first, b""), composite(kg_last + 1, b"")):
        kg, rest = split(sort_key)
        if rest[:1] != STATE or value is None:
            continue  # the timer index: the bundles carry the timers themselves
        kb = rest[1:]
        backend.import_key(
            kg, kb, decode_bundle(value, f"run entry of key {kb!r} (key-group {kg})")
        )
        n += 1
    return n


def load_key_groups(
    store: ObjectStore,
    runs: Sequence[RunRef],
    backend: KeyedStateBackend,
    key_groups: Iterable[int],
) -> CacheStats:
    """Load every key of ``key_groups`` from ``runs`` (a manifest's, newest first per
    key-group) into ``backend`` through a fresh cache, one scan per contiguous stretch
    (tools, reshard, whole-instance restores); returns what the reads cost."""
    cache = BlockCache(store)
    spans: list[list[int]] = []
    for kg in sorted(set(key_groups)):
        if spans and kg == spans[-1][1] + 1:
            spans[-1][1] = kg
        else:
            spans.append([kg, kg])
    for first, last in spans:
        load_range(cache, clip_runs(runs, KeyGroupRange(first, last)), backend, first, last)
    return cache.stats


def write_all_keys(
    store: ObjectStore,
    layout: RunNames,
    backend: KeyedStateBackend,
    batch_id: int,
    instance: int,
    attempt: str,
) -> tuple[Written, Loaded]:
    """Every key of ``backend`` (an instance's whole state: reshard, tools) as the
    instance's one run, with the timer index. The :class:`Loaded` returned counts each key
    and processing-time timer as gained, so its changes are the key-groups' counts."""
    mark_all_changed(backend)
    loaded = Loaded()
    entries = changed_entries(backend, loaded)
    written = write_batch_run(
        store, layout, BlockCache(store), [], entries, batch_id, instance, attempt,
        backend.key_groups,
    )  # fmt: skip
    return written, loaded
