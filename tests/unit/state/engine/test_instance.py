"""State in sorted runs: a batch loads only its keys and due timers, writes only what it
changed, and the next batch (at any parallelism) reads the newest state."""

from __future__ import annotations

from pathlib import Path

import pytest

from microbatch.checkpoint import Layout
from microbatch.keygroups import encode_key, key_group_range
from microbatch.state import KeyedStateBackend
from microbatch.state.engine import instance
from microbatch.state.engine.blockcache import BlockCache, RunRef
from microbatch.state.engine.bundle import state_key
from microbatch.state.engine.instance import (
    Loaded,
    changed_entries,
    load_due_timers,
    load_keys,
    write_changes,
)
from microbatch.storage import open_store
from microbatch.storage.counting import CountingStore

MAXP = 8


class Instance:
    """One batch of one instance, the way stage 2 will run it."""

    def __init__(self, store, runs: list[RunRef], parallelism: int, index: int) -> None:
        self.store, self.runs = store, runs
        self.range = key_group_range(MAXP, parallelism, index)
        self.backend = KeyedStateBackend(MAXP, self.range, clock=lambda: 0.0)
        self.cache = BlockCache(store)
        self.loaded = Loaded()

    def count(self, users: list[str]) -> None:
        load_keys(self.cache, self.runs, self.backend, [encode_key(u) for u in users], self.loaded)
        for u in users:
            ctx = self.backend.for_key(u)
            ctx.value("n").set(ctx.value("n").get(0) + 1)

    def commit(self, batch_id: int, index: int) -> RunRef | None:
        entries = changed_entries(self.backend, self.loaded)
        return write_changes(
            self.store, Layout(), entries, batch_id, index, f"a{batch_id}", self.range
        )


def users(n: int) -> list[str]:
    return [f"user-{i}" for i in range(n)]


def run_batch(store, runs, parallelism, batch_id, keys, work) -> list[RunRef]:
    """Every instance loads and changes its share of ``keys``; returns the runs, newest first."""
    new = []
    for i in range(parallelism):
        inst = Instance(store, runs, parallelism, i)
        share = [u for u in keys if inst.range.start <= _kg(u) <= inst.range.end]
        work(inst, share)
        ref = inst.commit(batch_id, i)
        if ref is not None:
            new.append(ref)
    return new + runs


def _kg(user: str) -> int:
    from microbatch.keygroups import key_group

    return key_group(user, MAXP)


def read_all(store, runs, keys) -> dict[str, int]:
    inst = Instance(store, runs, 1, 0)
    load_keys(inst.cache, runs, inst.backend, [encode_key(u) for u in keys], inst.loaded)
    return {
        u: inst.backend.for_key(u).value("n").get() for u in keys if inst.backend.describe_key(u)
    }


@pytest.fixture
def store(tmp_path: Path) -> CountingStore:
    return CountingStore(open_store(str(tmp_path)))


def test_the_next_batch_reads_the_newest_state_at_another_parallelism(store) -> None:
    runs = run_batch(store, [], 2, 0, users(300), Instance.count)
    runs = run_batch(store, runs, 3, 1, users(100), Instance.count)  # rescaled 2 -> 3

    assert read_all(store, runs, users(300)) == {
        u: 2 if i < 100 else 1 for i, u in enumerate(users(300))
    }


def test_a_batch_writes_only_the_keys_it_changed(store) -> None:
    runs = run_batch(store, [], 2, 0, users(20_000), Instance.count)
    first = store.bytes_written
    store.reset()

    run_batch(store, runs, 2, 1, users(200), Instance.count)

    assert store.bytes_written < 0.05 * first  # 200 of 20,000 keys changed (1 %)


def test_a_key_cleared_of_all_state_reads_as_absent(store) -> None:
    runs = run_batch(store, [], 1, 0, users(10), Instance.count)

    def clear(inst: Instance, keys: list[str]) -> None:
        load_keys(inst.cache, inst.runs, inst.backend, [encode_key(u) for u in keys], inst.loaded)
        for u in keys:
            inst.backend.for_key(u).value("n").clear()

    runs = run_batch(store, runs, 1, 1, ["user-3"], clear)
    assert "user-3" not in read_all(store, runs, users(10))
    assert len(read_all(store, runs, users(10))) == 9


def test_a_key_without_state_before_or_after_gets_no_entry(store) -> None:
    """A key a batch touched and left empty (set then cleared, a timer that came and
    went) writes nothing, unless it had state, or was changed without being loaded."""
    runs = run_batch(store, [], 1, 0, ["had"], Instance.count)
    inst = Instance(store, runs, 1, 0)
    load_keys(inst.cache, runs, inst.backend, [encode_key(u) for u in ("had", "new")], inst.loaded)
    for u in ("had", "new"):
        inst.backend.for_key(u).value("n").set(5)
        inst.backend.for_key(u).value("n").clear()
        inst.backend.for_key(u).register_timer(7)
        inst.backend.for_key(u).delete_timer(7)
    inst.backend.for_key("unloaded").value("n").set(1)
    inst.backend.for_key("unloaded").value("n").clear()

    entries = changed_entries(inst.backend, inst.loaded)

    entry_of = {state_key(_kg(u), encode_key(u)): u for u in ("had", "new", "unloaded")}
    assert sorted(entry_of[k] for k, _ in entries) == ["had", "unloaded"]  # no "new"
    assert all(value is None for _, value in entries)  # deletions
    assert inst.loaded.key_count_changes == {_kg("had"): -1}


def test_due_timers_are_found_without_reading_every_key(store) -> None:
    def arm(inst: Instance, keys: list[str]) -> None:
        load_keys(inst.cache, inst.runs, inst.backend, [encode_key(u) for u in keys], inst.loaded)
        for n, u in enumerate(keys):
            ctx = inst.backend.for_key(u)
            ctx.value("n").set(n)
            if u in ("user-7", "user-1500"):
                ctx.register_timer(1_000)
            elif n % 2:
                ctx.register_timer(9_000)

    runs = run_batch(store, [], 1, 0, users(3000), arm)
    inst = Instance(store, runs, 1, 0)
    store.reset()

    due = load_due_timers(inst.cache, runs, inst.backend, 5_000, inst.loaded)
    fired = inst.backend.advance_watermark(5_000)

    assert due == 2 and sorted(t.key_bytes for t in fired) == sorted(
        [encode_key("user-7"), encode_key("user-1500")]
    )
    blocks = sum(len(inst.cache.index(r).blocks) for r in runs)
    # per key-group the one or two blocks where its timers start, plus the due keys' own
    assert inst.cache.stats.blocks_fetched <= 2 * MAXP + 2 < blocks
    ref = inst.commit(1, 0)  # the fired timers leave the index
    again = Instance(store, [ref, *runs], 1, 0)
    assert load_due_timers(again.cache, again.runs, again.backend, 5_000, again.loaded) == 0


def test_processing_time_timers_have_their_own_index_apart_from_event_time(store) -> None:
    """A processing-time timer fires by the batch's processing time, never by the
    watermark, survives the checkpoint (its own index), and leaves the index once fired."""
    from microbatch.state.engine.bundle import PROCESSING_TIMER

    def arm(inst: Instance, keys: list[str]) -> None:
        load_keys(inst.cache, inst.runs, inst.backend, [encode_key(u) for u in keys], inst.loaded)
        for u in keys:
            ctx = inst.backend.for_key(u)
            ctx.value("n").set(1)
            if u == "user-3":
                ctx.register_processing_timer(2_000)
            if u == "user-4":
                ctx.register_timer(2_000)

    runs = run_batch(store, [], 1, 0, users(50), arm)
    inst = Instance(store, runs, 1, 0)
    assert load_due_timers(inst.cache, runs, inst.backend, 10_000, inst.loaded) == 1  # user-4
    assert inst.backend.advance_watermark(10_000)[0].key_bytes == encode_key("user-4")
    assert inst.backend.advance_watermark(10_000) == []  # user-3's is not an event-time timer

    due = load_due_timers(inst.cache, runs, inst.backend, 1_999, inst.loaded, PROCESSING_TIMER)
    assert due == 0
    due = load_due_timers(inst.cache, runs, inst.backend, 2_000, inst.loaded, PROCESSING_TIMER)
    assert due == 1
    fired = inst.backend.advance_processing_time(2_000)
    assert [t.key_bytes for t in fired] == [encode_key("user-3")]
    ref = inst.commit(1, 0)
    again = Instance(store, [ref, *runs], 1, 0)
    left = load_due_timers(again.cache, again.runs, again.backend, 9_999, again.loaded,
                           PROCESSING_TIMER)  # fmt: skip
    assert left == 0


@pytest.mark.parametrize("ttl", [None, 60.0])
def test_keys_of_one_value_state_get_the_entries_their_exported_rows_would(store, ttl) -> None:
    """The many-keys write (one value state, no timers: a table join's table) builds the
    same entries and key counts as exporting each key's rows: loaded keys kept, changed,
    cleared; new keys; a key changed without being loaded; values long and short."""
    runs = run_batch(store, [], 1, 0, users(50), Instance.count)

    def loaded_batch() -> Instance:
        inst = Instance(store, runs, 1, 0)
        load_keys(inst.cache, runs, inst.backend, [encode_key(u) for u in users(80)], inst.loaded)
        for i, u in enumerate(users(80)):
            state = inst.backend.for_key(u).value("n", ttl=ttl)
            if i % 5 == 0:
                state.clear()
            elif i % 3:
                state.set({"i": i, "blob": "x" * (i * 997 % 70_000), "many": list(range(i))})
        inst.backend.for_key("unloaded").value("n", ttl=ttl).set(1)
        return inst

    fast, per_key = loaded_batch(), loaded_batch()
    assert instance._value_entries(per_key.backend, Loaded()) is not None  # the fast path's

    expected = instance._entries_per_key(per_key.backend, per_key.loaded)
    assert changed_entries(fast.backend, fast.loaded) == sorted(expected)
    assert fast.loaded.key_count_changes == per_key.loaded.key_count_changes != {}


def test_keys_with_timers_or_several_states_are_written_row_by_row(store) -> None:
    inst = Instance(store, [], 1, 0)
    inst.backend.for_key("a").value("n").set(1)
    assert instance._value_entries(inst.backend, inst.loaded) is not None
    inst.backend.for_key("a").register_timer(5)
    assert instance._value_entries(inst.backend, inst.loaded) is None
    inst.backend.for_key("a").delete_timer(5)
    inst.backend.for_key("b").list("seen").add(1)
    assert instance._value_entries(inst.backend, inst.loaded) is None
