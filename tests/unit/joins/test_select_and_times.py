"""The default select (merge), event times of join records and signed durations."""

from __future__ import annotations

import datetime as dt
import doctest

import pytest

from microbatch.errors import ConfigError
from microbatch.joins import select as select_module
from microbatch.joins.select import fields, merge
from microbatch.joins.times import (
    EventTimeOf,
    RecordTimeError,
    signed_duration_ms,
    to_epoch_ms,
)
from microbatch.runtime.decoding import event_time_ms


def test_the_module_examples_hold():
    assert doctest.testmod(select_module).failed == 0


def test_merge_keeps_left_fields_and_renames_a_differing_right_field():
    left = {"id": 1, "price": 5, "price_right": 0}
    right = {"id": 1, "price": 7, "seller": "s"}
    assert merge(left, right) == {
        "id": 1,
        "price": 5,
        "price_right": 0,
        "price_right_right": 7,
        "seller": "s",
    }
    assert left == {"id": 1, "price": 5, "price_right": 0}  # inputs untouched


def test_merge_of_an_outer_row_has_the_present_side_only():
    assert merge({"a": 1}, None) == {"a": 1}
    assert merge(None, {"b": 2}) == {"b": 2}


def test_merge_refuses_records_that_are_not_dicts():
    with pytest.raises(TypeError, match="the right record is a list"):
        merge({"a": 1}, [1])


@pytest.mark.parametrize(
    ("value", "ms"),
    [
        (1_700_000_000_123, 1_700_000_000_123),
        (1.9, 1),
        ("2024-01-01T00:00:00.250Z", 1_704_067_200_250),
        ("2024-01-01T01:00:00+01:00", 1_704_067_200_000),
        ("2024-01-01T00:00:00", 1_704_067_200_000),
        (dt.datetime(2024, 1, 1, tzinfo=dt.UTC), 1_704_067_200_000),
        (dt.datetime(2024, 1, 1), 1_704_067_200_000),
        (dt.datetime(1969, 12, 31, 23, 59, 59, 999_500, tzinfo=dt.UTC), -1),
    ],
)
def test_event_times_are_epoch_ms(value, ms):
    assert to_epoch_ms(value) == ms
    assert event_time_ms(value) == ms  # as stage 1 reads the pipeline's event time


@pytest.mark.parametrize("value", [True, "soon", float("nan"), [1], b"1"])
def test_values_that_are_no_time_are_refused(value):
    with pytest.raises(ValueError):
        to_epoch_ms(value)


def test_event_time_of_a_record_names_what_is_wrong():
    of = EventTimeOf("IntervalJoin", "left_time", "ts")
    assert of({"ts": 5}) == 5
    with pytest.raises(RecordTimeError) as e:
        of({"x": 1})
    assert (e.value.reason, e.value.error) == (
        "missing_event_time",
        "record has no event time (field 'ts')",
    )
    with pytest.raises(RecordTimeError) as e:
        EventTimeOf("J", "right_time", lambda r: r["t"])({})
    assert e.value.reason == "bad_event_time"
    assert "right_time function raised KeyError" in e.value.error


@pytest.mark.parametrize("ts", [2**63, -(2**63) - 1])
def test_an_int_event_time_beyond_64_bits_is_a_bad_event_time_not_a_crash_later(ts):
    of = EventTimeOf("WindowJoin", "left_time", "ts")
    assert of({"ts": 2**63 - 1}) == 2**63 - 1
    with pytest.raises(RecordTimeError) as e:
        of({"ts": ts})
    assert e.value.reason == "bad_event_time"
    assert "out of range" in e.value.error


@pytest.mark.parametrize(
    ("value", "ms"),
    [
        ("-10m", -600_000),
        ("+1h", 3_600_000),
        (" 250ms ", 250),
        ("0s", 0),
        (-5, -5),
        (dt.timedelta(minutes=-1), -60_000),
        (dt.timedelta(0), 0),
    ],
)
def test_signed_durations(value, ms):
    assert signed_duration_ms("bound", value) == ms


@pytest.mark.parametrize("value", ["-", "--1m", "1 hour", 1.5, True, None, dt.timedelta(0, 0, 1)])
def test_bad_signed_durations_are_refused_with_the_value(value):
    with pytest.raises(ConfigError, match=r"bound must be a duration like '-10m'"):
        signed_duration_ms("bound", value)


def test_fields_picks_and_renames_each_sides_fields_left_first():
    pick = fields(left=["id", "price"], right={"seller_name": "name", "city": "city"})
    assert pick.names == ["id", "price", "seller_name", "city"]
    out = pick({"id": 1, "price": 5, "x": 0}, {"name": "Ann", "city": "Oslo", "id": 1})
    assert list(out.items()) == [("id", 1), ("price", 5), ("seller_name", "Ann"), ("city", "Oslo")]


def test_fields_of_a_missing_side_are_none_like_a_sql_outer_join():
    pick = fields(left=["id"], right=["name"])
    assert pick({"id": 1}, None) == {"id": 1, "name": None}
    assert pick(None, {"name": "Ann"}) == {"id": None, "name": "Ann"}


def test_fields_naming_a_field_a_record_lacks_says_which_and_of_which_side():
    with pytest.raises(KeyError, match=r"reads \['city'\] of the right record"):
        fields(right=["name", "city"])({}, {"name": "Ann"})


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"left": ["id"], "right": ["id"]}, r"names output field\(s\) \['id'\] twice"),
        ({}, "names no field"),
        ({"left": "id"}, "a list of names, not one string"),
        ({"right": {"a": 1}}, "takes field names"),
    ],
)
def test_fields_refuses_what_cannot_make_a_record(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        fields(**kwargs)


def test_times_of_an_integer_column_are_those_of_the_records():
    import pyarrow as pa

    records = [{"ts": 1_000}, {"ts": None}, {"ts": 2**62}, {"ts": -5}]
    table = pa.Table.from_pylist(records)
    for kind in (pa.int64(), pa.int32()):
        if kind == pa.int32():
            table = pa.table({"ts": pa.array([1_000, None, None, -5], kind)})
            records = table.to_pylist()
        got = EventTimeOf("Join", "left_time", "ts").plain_column(table)
        assert got is not None
        assert got.tolist() == EventTimeOf("Join", "left_time", "ts").plain(records).tolist()
    text = pa.table({"ts": ["2024-01-01T00:00:00Z"]})
    assert EventTimeOf("Join", "left_time", "ts").plain_column(text) is None  # read per record
    assert EventTimeOf("Join", "left_time", "other").plain_column(table) is None
    assert EventTimeOf("Join", "left_time", lambda r: r["ts"]).plain_column(table) is None
