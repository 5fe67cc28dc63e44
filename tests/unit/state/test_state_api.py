"""Value/list/map state, TTL on an injected clock, timers, dirty tracking."""

from __future__ import annotations

import pytest

from microbatch.errors import StateError
from microbatch.keygroups import KeyGroupRange, encode_key, key_group
from microbatch.state import KeyedStateBackend


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def backend(clock) -> KeyedStateBackend:
    return KeyedStateBackend(16, KeyGroupRange(0, 15), clock=clock)


def test_value_state_set_get_clear(backend):
    s = backend.for_key("a").value("count")
    assert s.get() is None and s.get(0) == 0
    s.set(5)
    assert backend.for_key("a").value("count").get() == 5
    assert backend.for_key("b").value("count").get() is None
    s.clear()
    assert s.get() is None


def test_returned_values_are_copies(backend):
    s = backend.for_key("a").value("v")
    s.set([1, 2])
    s.get().append(3)
    assert s.get() == [1, 2]


def test_a_value_read_in_a_loop_follows_every_write_expiry_and_restore(backend, clock):
    """``get`` decodes a stored value once per write: what it returns must still be what
    state holds after a set, a clear, an expiry or a restore, through the same handle."""
    a = backend.for_key("a")
    total = a.value("total", ttl=10)
    assert [total.get(0) for _ in range(3)] == [0, 0, 0]
    for n in (5, 7, 7):
        total.set(n)
        assert total.get() == total.get() == n
    a.value("total", ttl=10).set(9)  # another handle on the same state
    assert total.get() == 9
    rows = backend.export_key(key_group("a", 16), a.key_bytes)
    total.set(1)
    assert total.get() == 1
    backend.import_key(key_group("a", 16), a.key_bytes, rows)  # a restore: 9 again
    assert total.get() == 9
    clock.now += 11
    assert total.get("gone") == "gone"
    total.set(3)
    total.clear()
    assert total.get() is None


def test_list_state_add_update_clear(backend):
    s = backend.for_key("a").list("events")
    s.add(1)
    s.add_all([2, 3])
    assert s.get() == [1, 2, 3]
    s.update(["x"])
    assert s.get() == ["x"]
    s.clear()
    assert s.get() == []


def test_map_state_put_get_remove_iterate(backend):
    m = backend.for_key("a").map("seen")
    m.put("x", 1)
    m.put(("t", 2), {"n": 2})
    assert m.get("x") == 1 and ("t", 2) in m and "y" not in m
    assert m.to_dict() == {"x": 1, ("t", 2): {"n": 2}}
    m.remove("x")
    assert list(m.keys()) == [("t", 2)]
    m.clear()
    assert m.to_dict() == {}


def test_state_kind_cannot_change(backend):
    backend.for_key("a").value("s").set(1)
    with pytest.raises(StateError, match="'s' is value state"):
        backend.for_key("a").list("s")


def test_key_outside_instance_range_is_refused(clock):
    kg = key_group("a", 16)
    other = KeyGroupRange(0, 15).intersection(KeyGroupRange(kg + 1, 15))
    b = KeyedStateBackend(16, other if not other.is_empty else KeyGroupRange(0, kg - 1))
    with pytest.raises(StateError, match=f"key-group {kg}"):
        b.for_key("a")
    with pytest.raises(StateError, match=f"key-group {kg}"):
        b.for_placed("a", encode_key("a"), kg)  # a batch's placement is checked too


def test_a_placed_key_reaches_the_same_state_as_for_key(backend):
    backend.for_placed("a", encode_key("a"), key_group("a", 16)).value("s").set(1)
    assert backend.for_key("a").value("s").get() == 1


def test_writes_mark_the_key_group_dirty(backend):
    ctx = backend.for_key("a")
    assert backend.dirty == set()
    ctx.map("m").put(1, 1)
    assert backend.dirty == {ctx.key_group}


def test_ttl_entries_are_invisible_after_expiry(backend, clock):
    ctx = backend.for_key("a")
    ctx.value("v", ttl=10).set("x")
    ctx.list("l", ttl=10).add(1)
    ctx.map("m", ttl=10).put("k", 1)
    clock.now += 9.9
    assert ctx.value("v", ttl=10).get() == "x"
    ctx.list("l", ttl=10).add(2)  # written later: lives longer
    clock.now += 0.2
    assert ctx.value("v", ttl=10).get() is None
    assert ctx.list("l", ttl=10).get() == [2]
    assert ctx.map("m", ttl=10).to_dict() == {}


def test_ttl_write_restarts_the_clock(backend, clock):
    s = backend.for_key("a").value("v", ttl=10)
    s.set(1)
    clock.now += 8
    s.set(2)
    clock.now += 8
    assert s.get() == 2


def test_prune_drops_expired_entries_and_marks_dirty(backend, clock):
    ctx = backend.for_key("a")
    ctx.value("v", ttl=5).set(1)
    ctx.value("keep").set(2)
    backend.dirty.clear()
    clock.now += 6
    backend.prune_expired()
    assert backend.dirty == {ctx.key_group}
    rows = backend.export_rows(ctx.key_group)
    assert rows["state"] == ["keep"]


def test_prune_before_expiry_changes_nothing(backend, clock):
    backend.for_key("a").value("v", ttl=5).set(1)
    backend.dirty.clear()
    clock.now += 4
    backend.prune_expired()
    assert backend.dirty == set()


def test_timers_fire_in_timestamp_order_when_watermark_passes(backend):
    for key, ts in [("a", 30), ("b", 10), ("c", 20), ("a", 10), ("d", 50)]:
        backend.for_key(key).register_timer(ts)
    fired = backend.advance_watermark(30)
    assert [t.timestamp for t in fired] == [10, 10, 20, 30]
    assert backend.advance_watermark(40) == []
    assert [t.timestamp for t in backend.advance_watermark(50)] == [50]


def test_timer_register_twice_fires_once_and_delete_cancels(backend):
    ctx = backend.for_key("a")
    ctx.register_timer(5)
    ctx.register_timer(5)
    ctx.register_timer(7)
    ctx.delete_timer(7)
    assert ctx.timers() == [5]
    assert len(backend.advance_watermark(100)) == 1


def test_timer_callback_sees_state_and_can_register_due_timers(backend):
    backend.for_key("a").value("n").set(1)
    backend.for_key("a").register_timer(10)
    seen = []

    def on_timer(ctx, ts):
        seen.append((ctx.key, ts, ctx.value("n").get()))
        if ts == 10:
            ctx.register_timer(15)

    backend.advance_watermark(20, on_timer)
    assert seen == [("a", 10, 1), ("a", 15, 1)]


def test_a_keys_timer_stamps_are_a_snapshot(backend):
    ctx = backend.for_key("a")
    assert backend.timers.stamps(ctx.key_group, ctx.key_bytes) == frozenset()
    ctx.register_timer(10)
    before = backend.timers.stamps(ctx.key_group, ctx.key_bytes)
    ctx.register_timer(20)
    ctx.delete_timer(10)
    assert before == {10}  # what a checkpoint compares against stays as it was
    assert backend.timers.stamps(ctx.key_group, ctx.key_bytes) == {20}


def test_late_watermark_fires_nothing(backend):
    backend.advance_watermark(100)
    backend.for_key("a").register_timer(50)
    assert backend.advance_watermark(60) == []
    assert len(backend.advance_watermark(100)) == 1


def test_rows_round_trip_through_import(backend, clock):
    ctx = backend.for_key("a")
    ctx.value("v").set(1)
    ctx.list("l", ttl=100).add_all([1, 2])
    ctx.map("m").put("x", [1])
    ctx.register_timer(9)
    rows = backend.export_rows(ctx.key_group)
    other = KeyedStateBackend(16, KeyGroupRange(0, 15), clock=clock)
    other.import_rows(ctx.key_group, rows)
    assert other.describe_key("a") == {"v": 1, "l": [1, 2], "m": {"x": [1]}, "timers": [9]}
    assert other.dirty == set()


@pytest.mark.parametrize("ttl", [None, 5.0])
def test_many_keys_set_at_once_hold_what_setting_each_would(ttl) -> None:
    """``KeyedValues.set_many`` (a table join's write of a batch's keys) leaves the same
    values, the same changed keys and the same expiry as ``set`` on each key."""
    from microbatch.state.handles import KeyedValues

    now = [100.0]
    one, many = (KeyedStateBackend(16, KeyGroupRange(0, 15), clock=lambda: now[0]) for _ in "ab")
    keys = [f"k{i}" for i in range(40)]
    for k in keys:
        one.for_key(k).value("v", ttl).set({"k": k})
    placed = [encode_key(k) for k in keys]
    spec = many.declare("v", "value", ttl)
    values = KeyedValues(many, spec, [key_group(k, 16) for k in keys], placed)
    values.set_many(list(range(40)), [{"k": k} for k in keys])

    def held(b: KeyedStateBackend) -> list:
        return [b.export_rows(kg) for kg in range(16)]

    assert held(many) == held(one)
    assert (many.dirty, many.dirty_keys) == (one.dirty, one.dirty_keys)
    now[0] += 10  # past the TTL, if any
    one.prune_expired()
    many.prune_expired()
    assert held(many) == held(one)
    assert any(r["key"] for r in held(one)) == (ttl is None)


def test_many_keys_read_at_once_read_what_getting_each_would() -> None:
    """``KeyedValues.get_many``: stored values, the default for a key without one, and for
    one whose TTL has passed."""
    from microbatch.state.handles import KeyedValues

    now = [100.0]
    backend = KeyedStateBackend(16, KeyGroupRange(0, 15), clock=lambda: now[0])
    backend.for_key("kept").value("v").set([1, "one"])
    backend.for_key("short").value("v", ttl=5.0).set("gone soon")
    now[0] += 10
    keys = ["kept", "short", "never"]
    spec = backend.declare("v", "value", None)
    placed = [encode_key(k) for k in keys]
    values = KeyedValues(backend, spec, [key_group(k, 16) for k in keys], placed)

    assert values.get_many([0, 1, 2, 0], default="none") == [[1, "one"], "none", "none", [1, "one"]]
    assert [values.get(k, "none") for k in (0, 1, 2)] == [[1, "one"], "none", "none"]
