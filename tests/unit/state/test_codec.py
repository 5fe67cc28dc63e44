"""The value codec: documented types round-trip with their exact types, in both forms (the
msgpack fast form ``P`` and the tagged form); bytes written by earlier releases still decode;
everything else is refused."""

from __future__ import annotations

import contextlib
import datetime as dt
import math
import random
import sys
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from microbatch.keygroups import KeyGroupRange
from microbatch.state import KeyedStateBackend
from microbatch.state.codec import (
    CodecError,
    decode_value,
    decode_values,
    encode_canonical,
    encode_value,
)

scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.text()
    | st.binary()
    | st.floats()
    | st.dates()
    | st.datetimes(timezones=st.just(dt.UTC))
)
values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.lists(inner, max_size=4).map(tuple)
        | st.dictionaries(st.text() | st.integers(), inner, max_size=4)
    ),
    max_leaves=10,
)


@settings(max_examples=200, deadline=None)
@given(values)
def test_supported_values_round_trip(value):
    assert_same(decode_value(encode_value(value)), value)
    assert_same(decode_value(encode_canonical(value)), value)


def assert_same(decoded, expected, path="value"):
    """Equal with exactly the same types all the way down (tuple is not list, True is not 1,
    NaN equals NaN, -0.0 is not 0.0); bytes-likes decode as bytes."""
    want = bytes if isinstance(expected, bytearray | memoryview) else type(expected)
    assert type(decoded) is want, f"{path}: {type(decoded).__name__} != {want.__name__}"
    if isinstance(expected, float):
        assert repr(decoded) == repr(expected) or (math.isnan(decoded) and math.isnan(expected))
    elif isinstance(expected, list | tuple):
        assert len(decoded) == len(expected), path
        for i, (d, e) in enumerate(zip(decoded, expected, strict=True)):
            assert_same(d, e, f"{path}[{i}]")
    elif isinstance(expected, dict):
        assert list(decoded) == list(expected), f"{path}: keys or their order differ"
        for (dk, dv), (ek, ev) in zip(decoded.items(), expected.items(), strict=True):
            assert_same(dk, ek, f"{path} key {ek!r}")
            assert_same(dv, ev, f"{path}[{ek!r}]")
    else:
        assert decoded == expected, path


def random_value(rng: random.Random, depth: int = 0):
    """A random nested value mixing msgpack-exact types with ones that are not."""
    kind = rng.randrange(16 if depth < 3 else 11)
    if kind == 0:
        return rng.choice([None, True, False])
    if kind == 1:
        return rng.choice([0, 1, -1, 127, 128, -33, 2**31, 2**63 - 1, -(2**63), 2**64 - 1])
    if kind == 2:
        return rng.choice([2**64, -(2**63) - 1, 3**90, -(7**40)])  # beyond MessagePack
    if kind == 3:
        return rng.choice([0.0, -0.0, 1.5, math.inf, -math.inf, math.nan, 1e-310, 2.0**1000])
    if kind == 4:
        return "".join(rng.choice("aé€𝄞 \x00") for _ in range(rng.randrange(40)))
    if kind == 5:
        return rng.randbytes(rng.randrange(300))
    if kind == 6:
        return bytearray(rng.randbytes(3))
    if kind == 7:
        return dt.datetime(2024, 1, 1, tzinfo=dt.UTC) + dt.timedelta(
            microseconds=rng.getrandbits(50)
        )
    if kind == 8:
        return dt.date.fromordinal(rng.randrange(1, 800_000))
    if kind == 9:
        return rng.randrange(-(2**40), 2**40)
    if kind == 10:
        return "x" * rng.randrange(70_000) if rng.random() < 0.02 else "k"
    if kind in (11, 12):
        return [random_value(rng, depth + 1) for _ in range(rng.randrange(5))]
    if kind == 13:
        return tuple(random_value(rng, depth + 1) for _ in range(rng.randrange(4)))
    keys = [
        rng.choice(["a", "b", 1, -2, b"k", None, True, 2.5, (1, "t"), "z" * 40]) for _ in range(4)
    ]
    return {k: random_value(rng, depth + 1) for k in keys}


def test_random_nested_values_round_trip_with_exact_types():
    rng = random.Random(20261127)
    forms = set()
    for _ in range(3000):
        value = random_value(rng)
        encoded = encode_value(value)
        forms.add(encoded[:1] == b"P")
        assert_same(decode_value(encoded), value)
        assert_same(decode_value(encode_canonical(value)), value)
    assert forms == {True, False}  # both forms were exercised


@pytest.mark.parametrize(
    "value",
    [
        {"auction": 7, "price": 1234567, "channel": "web", "tags": ["a", b"b"], "n": None},
        [1, 2**64 - 1, -(2**63), True, 0.5, "é", b"\x00"],
        {1: "int key", b"k": "bytes key", None: 1, False: True, 2.5: "float key"},
        "plain",
        -0.0,
        math.nan,
        [],
        {},
    ],
)
def test_plain_values_take_the_fast_form(value):
    encoded = encode_value(value)
    assert encoded[:1] == b"P"
    assert_same(decode_value(encoded), value)


@pytest.mark.parametrize(
    "value",
    [
        (1, 2),
        {"a": [1, (2,)]},
        {(1, "fr"): 2},
        2**64,
        [-(2**63) - 1],
        {"at": dt.datetime(2024, 1, 1, tzinfo=dt.UTC)},
        [dt.date(2024, 1, 1)],
        {"nested": {"deep": [[[[["x"]]]]] * 3, "t": ()}},
    ],
)
def test_values_msgpack_cannot_keep_exactly_take_the_tagged_form(value):
    encoded = encode_value(value)
    assert encoded == encode_canonical(value) and encoded[:1] != b"P"
    assert_same(decode_value(encoded), value)


@pytest.mark.parametrize("depth", [1, 500, 1000, 1021, 1022, 1023, 1024, 1025, 1026, 1100])
@pytest.mark.parametrize("shape", ["[x]", "[x, 1]", "{k: x}"])
def test_deeply_nested_values_decode_whatever_form_they_take(depth, shape):
    """msgpack packs deeper than it unpacks: values near its limits must still decode."""
    value: list | dict = []
    for _ in range(depth):
        value = {"k": value} if shape == "{k: x}" else [value, 1] if shape == "[x, 1]" else [value]
    with raised_recursion_limit(5000):  # the tagged form recurses in Python
        encoded = encode_value(value)
        assert decode_value(encoded) == value
    if depth < 1000:
        assert encoded[:1] == b"P"


@contextlib.contextmanager
def raised_recursion_limit(limit: int):
    old = sys.getrecursionlimit()
    sys.setrecursionlimit(max(old, limit))
    try:
        yield
    finally:
        sys.setrecursionlimit(old)


# Bytes written by earlier releases (the tagged form): they must decode to these values for
# as long as checkpoints of those releases may be restored.
LEGACY_BYTES = [
    (None, b"N"),
    (True, b"T"),
    (False, b"F"),
    (300, b"i\x02\x01,"),
    (-(2**70), b"i\t\xc0\x00\x00\x00\x00\x00\x00\x00\x00"),
    (1.5, b"f?\xf8\x00\x00\x00\x00\x00\x00"),
    ("hé", b"s\x03h\xc3\xa9"),
    (b"\x00\xff", b"b\x02\x00\xff"),
    ([1, "a"], b"l\x02i\x01\x01s\x01a"),
    ((1, None), b"t\x02i\x01\x01N"),
    ({"k": [True], 2: 2.5}, b"d\x02s\x01kl\x01Ti\x01\x02f@\x04\x00\x00\x00\x00\x00\x00"),
    (dt.datetime(2024, 5, 1, 12, 0, 0, 7, tzinfo=dt.UTC), b"D\x00\x06\x17c9\xd90\x07"),
    (dt.date(2024, 2, 29), b"a\x00\x0bF\x81"),
]


@pytest.mark.parametrize(("value", "data"), LEGACY_BYTES)
def test_bytes_of_earlier_releases_decode_and_stay_canonical(value, data):
    assert_same(decode_value(data), value)
    assert encode_canonical(value) == data


# The fast form: tag P + standard MessagePack (fixmap, fixstr, uint32, bin 8, true, nil,
# float 64, fixarray, uint 64). Fixed so that a msgpack upgrade changing it is noticed.
FAST_BYTES = [
    (
        {
            "auction": 7,
            "price": 1234567,
            "channel": "web",
            "extra": b"\x01",
            "ok": True,
            "none": None,
            "ratio": 0.5,
        },
        b"P\x87\xa7auction\x07\xa5price\xce\x00\x12\xd6\x87\xa7channel\xa3web\xa5extra"
        b"\xc4\x01\x01\xa2ok\xc3\xa4none\xc0\xa5ratio\xcb?\xe0\x00\x00\x00\x00\x00\x00",
    ),
    ([1, -1, 2**63, "x"], b"P\x94\x01\xff\xcf\x80\x00\x00\x00\x00\x00\x00\x00\xa1x"),
    ("hé", b"P\xa3h\xc3\xa9"),
    (300, b"P\xcd\x01,"),
]


@pytest.mark.parametrize(("value", "data"), FAST_BYTES)
def test_fast_form_bytes_are_stable(value, data):
    assert encode_value(value) == data
    assert_same(decode_value(data), value)


def test_a_failed_fast_attempt_leaves_nothing_behind():
    """The per-thread packer is reused: a value refused halfway must not leak its partial
    bytes into the next value's encoding."""
    assert encode_value({"a": "x" * 100, "b": (1,)})[:1] == b"d"
    assert encode_value(300) == b"P\xcd\x01,"


def test_threads_encode_independently():
    values = [{"thread": t, "items": list(range(t * 50))} for t in range(8)]
    results: dict[int, list[bytes]] = {}

    def work(t: int) -> None:
        results[t] = [encode_value(values[t]) for _ in range(300)]

    threads = [threading.Thread(target=work, args=(t,)) for t in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for t, encodings in results.items():
        assert all(decode_value(e) == values[t] for e in encodings)


def test_map_state_finds_fields_written_by_earlier_releases():
    """Map fields are compared by their bytes: they stay in the tagged form, so a field an
    earlier release wrote (restored from a checkpoint) is still found and replaced."""
    backend = KeyedStateBackend(16, KeyGroupRange(0, 15))
    ctx = backend.for_key("k")
    ctx.map("seen").put(["fr", 2024], "old")  # a list field: plain, would take the P form
    rows = backend.export_rows(ctx.key_group)
    assert rows["field"] == [b"l\x02s\x02fri\x02\x07\xe8"]  # as HEAD~ wrote it
    restored = KeyedStateBackend(16, KeyGroupRange(0, 15))
    restored.import_rows(ctx.key_group, rows)
    seen = restored.for_key("k").map("seen")
    assert seen.get(["fr", 2024]) == "old"
    seen.put(["fr", 2024], "new")
    assert list(seen.items()) == [(["fr", 2024], "new")]


def test_types_are_preserved():
    decoded = decode_value(encode_value([1, True, (1,), b"x", 1.0, dt.date(2024, 1, 1)]))
    assert [type(v) for v in decoded] == [int, bool, tuple, bytes, float, dt.date]


def test_aware_datetime_decodes_in_utc():
    tz = dt.timezone(dt.timedelta(hours=2))
    value = dt.datetime(2024, 5, 1, 12, 0, tzinfo=tz)
    decoded = decode_value(encode_value(value))
    assert decoded == value and decoded.tzinfo == dt.UTC


@pytest.mark.parametrize("bad", [{1, 2}, object(), dt.datetime(2024, 1, 1), complex(1, 2)])
@pytest.mark.parametrize("where", ["alone", "in a dict"])
def test_unsupported_values_are_refused(bad, where):
    value = bad if where == "alone" else {"ok": 1, "bad": [bad]}
    with pytest.raises(
        CodecError,
        match=r"^(cannot encode state value of type \w+: supported are "
        r"None, bool, int, float, str, bytes, list, tuple, dict, aware datetime, "
        r"date|naive datetime .*: attach a timezone \(e\.g\. UTC\) first)$",
    ):
        encode_value(value)


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"s\x05ab",
        b"Z",
        b"i\x01\x01extra",
        b"f\x00",
        b"P",  # truncated
        b"P\x92\x01",  # truncated array
        b"P\xc1",  # a byte MessagePack never uses
        b"P\x01\x02",  # trailing bytes
        b"P\xd4\x01\x00",  # an extension type
        b"P\x81\x91\x01\x01",  # a list as map key
    ],
)
def test_corrupt_bytes_raise_codec_error(data):
    with pytest.raises(CodecError, match="corrupt"):
        decode_value(data)


def test_a_run_of_values_decodes_as_each_one_alone():
    rng = random.Random(7)
    values = [random_value(rng) for _ in range(400)]  # both forms, interleaved
    fast = [v for v in values if encode_value(v)[:1] == b"P"]
    for run in (values, fast, fast[:3], []):
        decoded = decode_values([encode_value(v) for v in run])
        assert len(decoded) == len(run)
        for got, value in zip(decoded, run, strict=True):
            assert_same(got, value)


@pytest.mark.parametrize("bad", [b"P", b"P\x92\x01", b"P\xc1", b"P\x01\x02", b"P\xd4\x01\x00"])
def test_a_corrupt_value_in_a_run_raises_as_it_alone_would(bad):
    run = [encode_value({"n": i}) for i in range(10)]
    run[4] = bad
    with pytest.raises(CodecError, match="corrupt"):
        decode_values(run)
