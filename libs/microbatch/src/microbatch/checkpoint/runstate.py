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
state it does not touch is never read. See :mod:`microbatch.state.bundle` for the entries.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

from microbatch.checkpoint.layout import Layout
from microbatch.keygroups import KeyGroupRange, key_group_of_bytes
from microbatch.state import KeyedStateBackend
from microbatch.state.blockcache import BlockCache, RunRef, lookup, scan
from microbatch.state.bundle import (
    decode_bundle,
    encode_bundle,
    parse_timer_key,
    state_key,
    timer_key,
    timers_until,
)
from microbatch.state.runs import Entry, encode_run
from microbatch.storage import ObjectStore


@dataclasses.dataclass
class Loaded:
    """What was loaded into the backend: each key's timers as they were (the write
    compares against them), and how many keys had state."""

    timers: dict[tuple[int, bytes], set[int]] = dataclasses.field(default_factory=dict)
    keys_found: int = 0


def load_keys(
    cache: BlockCache,
    runs: Sequence[RunRef],
    backend: KeyedStateBackend,
    keys: Iterable[bytes],
    loaded: Loaded,
) -> None:
    """Bring the state of ``keys`` (canonical key bytes of this instance's key-groups)
    into ``backend``; keys already loaded are skipped."""
    wanted = {}
    for kb in keys:
        kg = key_group_of_bytes(kb, backend.max_parallelism)
        if (kg, kb) not in loaded.timers:
            wanted[state_key(kg, kb)] = (kg, kb)
    found = lookup(cache, runs, wanted)
    for sort_key, (kg, kb) in sorted(wanted.items()):
        value = found.get(sort_key)
        if value is not None:
            rows = decode_bundle(value, f"run entry of key {kb!r} (key-group {kg})")
            backend.import_key(kg, kb, rows)
            loaded.keys_found += 1
        loaded.timers[kg, kb] = set(backend.timers.of_key(kg, kb))


def load_due_timers(
    cache: BlockCache,
    runs: Sequence[RunRef],
    backend: KeyedStateBackend,
    watermark: int,
    loaded: Loaded,
) -> int:
    """Load every key of this instance with a timer due by ``watermark``; returns how
    many timers are due."""
    due = []
    for kg in backend.key_groups:
        lo, hi = timers_until(kg, watermark)
        due += [parse_timer_key(k) for k, _ in scan(cache, runs, lo, hi)]
    load_keys(cache, runs, backend, {kb for _, _, kb in due}, loaded)
    return len(due)


def changed_entries(backend: KeyedStateBackend, loaded: Loaded) -> list[Entry]:
    """The run entries for every key the batch changed, in sort-key order."""
    out: list[Entry] = []
    for kg, kb in backend.dirty_keys:
        out.append((state_key(kg, kb), encode_bundle(backend.export_key(kg, kb))))
        now = set(backend.timers.of_key(kg, kb))
        before = loaded.timers.get((kg, kb), set())
        out += [(timer_key(kg, ts, kb), b"") for ts in now - before]
        out += [(timer_key(kg, ts, kb), None) for ts in before - now]
    out.sort(key=lambda e: e[0])
    return out


def run_keys(layout: Layout, batch_id: int, instance: int, attempt: str) -> tuple[str, str]:
    """The data and index objects of one instance's run of a batch (attempt-unique, so a
    zombie never overwrites a run a manifest names)."""
    stem = layout.state_key(batch_id, instance, attempt).removesuffix(".arrow")
    return f"{stem}.run.arrow", f"{stem}.index.arrow"


def write_changes(
    store: ObjectStore,
    layout: Layout,
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
