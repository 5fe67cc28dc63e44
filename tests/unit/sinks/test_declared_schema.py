"""A sink with a declared schema converts its records in one pass of Arrow's converter
(:func:`~microbatch.sinks.base.table_of_typed_dicts`), and the table is exactly the one
``pyarrow.Table.from_pylist(records, schema=...)`` gives — or that path is taken instead."""

from __future__ import annotations

import collections
import datetime as dt
import decimal
from typing import Any

import pyarrow as pa
import pytest

from microbatch.errors import SinkError
from microbatch.sinks.base import rows_to_table, table_of_typed_dicts

SCHEMA = pa.schema(
    [
        pa.field("id", pa.int64(), nullable=False, metadata={"doc": "the order"}),
        ("user", pa.string()),
        ("price", pa.float64()),
        ("at", pa.timestamp("ms", tz="UTC")),
        ("items", pa.list_(pa.struct([("sku", pa.string()), ("qty", pa.int32())]))),
        ("amount", pa.decimal128(9, 2)),
        ("labels", pa.map_(pa.string(), pa.int64())),
        ("channel", pa.dictionary(pa.int32(), pa.string())),
    ],
    metadata={"owner": "orders"},
)

RECORDS: list[dict[Any, Any]] = [
    {
        "id": 1,
        "user": "u1",
        "price": 2,  # an int in a float64 column
        "at": dt.datetime(2024, 5, 1, 12, tzinfo=dt.UTC),
        "items": [{"sku": "a", "qty": 2, "note": "dropped"}, None],
        "amount": decimal.Decimal("10.50"),
        "labels": {"x": 1},
        "channel": "web",
        "not_in_schema": "ignored",
    },
    {"id": 2, "price": 1.5, "labels": [("y", 2)]},  # missing fields: nulls
    {"id": 3, "user": "u3", "channel": None, "amount": None},
]


def test_plain_dicts_take_the_one_pass_path_and_give_from_pylists_table() -> None:
    fast = table_of_typed_dicts(RECORDS, SCHEMA)

    assert fast is not None
    expected = pa.Table.from_pylist(RECORDS, schema=SCHEMA)
    assert fast.equals(expected, check_metadata=True)
    assert fast.schema.equals(expected.schema, check_metadata=True)
    assert rows_to_table("orders", RECORDS, SCHEMA).equals(expected, check_metadata=True)


@pytest.mark.parametrize(
    "records",
    [
        # bytes keys: Arrow's converter would match them when no str key is found first
        [{b"id": 1}, {"id": 2}],
        # a tuple fills a struct by position, from_pylist finds no field in it
        [{"id": 1}, (2, "u2")],
        # a dict subclass may answer lookups its own way
        [collections.OrderedDict(id=1)],
        [],
    ],
    ids=["bytes-keys-first", "a-tuple", "a-dict-subclass", "empty"],
)
def test_records_whose_sameness_is_not_certain_take_from_pylist(records: list[Any]) -> None:
    assert table_of_typed_dicts(records, SCHEMA) is None
    if records:
        assert rows_to_table("orders", records, SCHEMA).equals(
            pa.Table.from_pylist(records, schema=SCHEMA), check_metadata=True
        )


def test_repeated_column_names_take_from_pylist() -> None:
    twice = pa.schema([("id", pa.int64()), ("id", pa.int64())])
    assert table_of_typed_dicts([{"id": 1}], twice) is None


def test_values_the_schema_refuses_fail_as_before_naming_the_sink() -> None:
    records = [{"id": 1, "price": 1.0}, {"id": 2, "price": "cheap"}]

    assert table_of_typed_dicts(records, SCHEMA) is None
    with pytest.raises(SinkError, match=r"sink 'orders': records do not fit its schema"):
        rows_to_table("orders", records, SCHEMA, "pipeline 'p' batch 3 instance 1")
