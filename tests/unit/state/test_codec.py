"""The value codec: documented types round-trip; everything else is refused."""

from __future__ import annotations

import datetime as dt

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from microbatch.state.codec import CodecError, decode_value, encode_value

scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.text()
    | st.binary()
    | st.floats(allow_nan=False)
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
    assert decode_value(encode_value(value)) == value


def test_types_are_preserved():
    decoded = decode_value(encode_value([1, True, (1,), b"x", 1.0, dt.date(2024, 1, 1)]))
    assert [type(v) for v in decoded] == [int, bool, tuple, bytes, float, dt.date]


def test_aware_datetime_decodes_in_utc():
    tz = dt.timezone(dt.timedelta(hours=2))
    value = dt.datetime(2024, 5, 1, 12, 0, tzinfo=tz)
    decoded = decode_value(encode_value(value))
    assert decoded == value and decoded.tzinfo == dt.UTC


@pytest.mark.parametrize("bad", [{1, 2}, object(), dt.datetime(2024, 1, 1), complex(1, 2)])
def test_unsupported_values_are_refused(bad):
    with pytest.raises(CodecError, match=r"cannot encode|naive"):
        encode_value(bad)


@pytest.mark.parametrize("data", [b"", b"s\x05ab", b"Z", b"i\x01\x01extra", b"f\x00"])
def test_corrupt_bytes_raise_codec_error(data):
    with pytest.raises(CodecError, match="corrupt"):
        decode_value(data)
