"""Key-group formulas (seed 004), canonical key bytes and validation."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from microbatch.errors import StateError
from microbatch.keygroups import (
    KeyGroupRange,
    decode_key,
    encode_key,
    key_group,
    key_group_range,
    operator_index,
    operator_indexes,
)


def test_seed_example_max10_splits_into_the_documented_ranges():
    assert [str(key_group_range(10, 2, i)) for i in range(2)] == ["[0-4]", "[5-9]"]
    assert [str(key_group_range(10, 3, i)) for i in range(3)] == ["[0-3]", "[4-6]", "[7-9]"]


def test_seed_example_rescale_2_to_3_moves_only_kg4_off_instance0():
    old, new = key_group_range(10, 2, 0), key_group_range(10, 3, 0)
    assert set(old) - set(new) == {4}


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 4096).flatmap(lambda m: st.tuples(st.just(m), st.integers(1, m))))
def test_every_key_group_belongs_to_exactly_one_instance(mp):
    max_p, p = mp
    owners = [None] * max_p
    for i in range(p):
        r = key_group_range(max_p, p, i)
        assert not r.is_empty, "each instance owns at least one key-group"
        for kg in r:
            assert owners[kg] is None
            owners[kg] = i
    assert None not in owners
    for kg in range(max_p):
        assert operator_index(kg, max_p, p) == owners[kg]


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 2**31), st.integers(1, 300))
def test_ranges_are_contiguous_and_balanced(seed, max_p):
    p = seed % max_p + 1
    sizes = [len(key_group_range(max_p, p, i)) for i in range(p)]
    assert sum(sizes) == max_p
    assert max(sizes) - min(sizes) <= 1


keys = st.recursive(
    st.text() | st.integers() | st.binary(),
    lambda inner: st.lists(inner, max_size=4).map(tuple),
    max_leaves=8,
)


@settings(max_examples=200, deadline=None)
@given(keys)
def test_key_encoding_round_trips(key):
    assert decode_key(encode_key(key)) == key


def test_key_encoding_is_pinned_across_processes_and_versions():
    # Changing any of these silently moves every key of every existing pipeline.
    assert encode_key("a") == b"sa"
    assert encode_key(0) == b"i\x00"
    assert encode_key(-1) == b"i\xff"
    assert encode_key(128) == b"i\x00\x80"
    assert encode_key(b"\x01") == b"y\x01"
    assert encode_key(("a", 1)) == b"t\x00\x00\x00\x02\x00\x00\x00\x02sa\x00\x00\x00\x02i\x01"
    assert [key_group(k, 128) for k in ("a", "user-42", 7, b"x", ("a", 1))] == [62, 16, 37, 86, 127]


def test_subclasses_of_str_and_int_encode_as_their_values():
    class Name(str):
        pass

    class Count(int):
        pass

    assert encode_key(Name("user-42")) == encode_key("user-42") == b"suser-42"
    assert encode_key(Count(-129)) == encode_key(-129) == b"i\xff\x7f"
    assert encode_key(2**70) == b"i" + (2**70).to_bytes(9, "big", signed=True)


@pytest.mark.parametrize(("max_p", "p"), [(1, 1), (10, 3), (128, 2), (128, 128), (32768, 7)])
def test_the_operator_index_table_is_operator_index_of_every_key_group(max_p, p):
    assert operator_indexes(max_p, p) == tuple(operator_index(kg, max_p, p) for kg in range(max_p))
    with pytest.raises(StateError, match="parallelism"):
        operator_indexes(max_p, max_p + 1)


def test_distinct_types_with_same_text_get_distinct_bytes():
    assert len({encode_key("1"), encode_key(1), encode_key(b"1"), encode_key(("1",))}) == 4


@pytest.mark.parametrize("bad", [True, 1.5, None, [1], {"a": 1}])
def test_unsupported_key_types_are_refused_naming_the_type(bad):
    with pytest.raises(StateError, match=type(bad).__name__):
        encode_key(bad)


@pytest.mark.parametrize(
    ("max_p", "p", "i", "bad"),
    [
        (10, 0, 0, "parallelism"),
        (10, 11, 0, ": 11"),
        (0, 1, 0, "max_parallelism"),
        (10, 2, 2, "operator index"),
        (40000, 1, 0, "40000"),
    ],
)
def test_invalid_ranges_raise_naming_the_value(max_p, p, i, bad):
    with pytest.raises(StateError, match=bad):
        key_group_range(max_p, p, i)


def test_operator_index_rejects_key_group_out_of_bounds():
    with pytest.raises(StateError, match=r"key-group must be in 0\.\.9: 10"):
        operator_index(10, 10, 2)


def test_key_group_range_value_type():
    r = KeyGroupRange(3, 6)
    assert list(r) == [3, 4, 5, 6] and len(r) == 4 and 3 in r and 7 not in r
    assert r.intersection(KeyGroupRange(5, 9)) == KeyGroupRange(5, 6)
    assert r.intersection(KeyGroupRange(7, 9)).is_empty
    assert len(KeyGroupRange.empty()) == 0 and list(KeyGroupRange.empty()) == []
    with pytest.raises(StateError):
        KeyGroupRange(5, 2)
    with pytest.raises(AttributeError):
        r.start = 0  # type: ignore[misc]
