"""A key's whole state travels as one bundle: exported, encoded, imported elsewhere, equal;
writes mark exactly the keys they touch as changed."""

from __future__ import annotations

import pytest

from microbatch.errors import CheckpointError
from microbatch.keygroups import KeyGroupRange, encode_key, key_group
from microbatch.state import KeyedStateBackend
from microbatch.state.engine.bundle import (
    decode_bundle,
    encode_bundle,
    parse_timer_key,
    state_key,
    timer_key,
    timers_until,
)

MAXP = 16


def backend() -> KeyedStateBackend:
    return KeyedStateBackend(MAXP, KeyGroupRange(0, MAXP - 1), clock=lambda: 1000.0)


def fill(b: KeyedStateBackend, key: str) -> None:
    ctx = b.for_key(key)
    ctx.value("count").set(3)
    ctx.list("pages", ttl=60).add_all(["/a", "/b"])
    ctx.map("seen").put(("fr", 2024), True)
    ctx.register_timer(5_000)


def test_a_key_exported_then_imported_elsewhere_reads_the_same() -> None:
    source, target = backend(), backend()
    fill(source, "ann")
    fill(source, "bob")
    kg, kb = key_group("ann", MAXP), encode_key("ann")

    bundle = encode_bundle(source.export_key(kg, kb))
    target.import_key(kg, kb, decode_bundle(bundle, "run r key ann"))

    assert target.describe_key("ann") == source.describe_key("ann")
    assert target.describe_key("bob") == {}  # only the key asked for came over
    assert target.export_rows(kg) == {
        c: [v for v, k in zip(vals, source.export_rows(kg)["key"], strict=True) if k == kb]
        for c, vals in source.export_rows(kg).items()
    }


def test_a_key_without_state_is_a_deletion() -> None:
    b = backend()
    fill(b, "ann")
    ctx = b.for_key("ann")
    for name in ("count", "pages", "seen"):
        getattr(ctx, {"count": "value", "pages": "list", "seen": "map"}[name])(name).clear()
    ctx.delete_timer(5_000)

    assert encode_bundle(b.export_key(key_group("ann", MAXP), encode_key("ann"))) is None


def test_writes_mark_exactly_the_keys_they_touch() -> None:
    b = backend()
    fill(b, "ann")
    b.for_key("bob").value("count").get()  # a read changes nothing

    assert b.dirty_keys == {(key_group("ann", MAXP), encode_key("ann"))}
    b.advance_watermark(10_000)
    assert b.dirty_keys == {(key_group("ann", MAXP), encode_key("ann"))}  # its timer fired


def test_a_bundle_that_is_not_a_key_state_is_an_error_naming_where() -> None:
    with pytest.raises(CheckpointError, match="run r1 key 7: the key's state"):
        decode_bundle(b"\xff\x00garbage", "run r1 key 7")


def test_timer_entries_sort_by_time_within_a_key_group_and_after_its_keys() -> None:
    times = [-5, 0, 7, 1_700_000_000_000, 2**62]
    entries = sorted(timer_key(3, ts, b"ann") for ts in reversed(times))

    assert [parse_timer_key(e) for e in entries] == [(3, ts, b"ann") for ts in times]
    assert state_key(3, b"\xff" * 8) < entries[0] < state_key(4, b"")
    lo, hi = timers_until(3, 7)
    assert [parse_timer_key(e)[1] for e in entries if lo <= e < hi] == [-5, 0, 7]
