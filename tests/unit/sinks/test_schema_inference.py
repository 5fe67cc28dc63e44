"""A sink without a declared schema keeps every field of every record: the columns are the
union of the records' fields (first-appearance order), each typed over all its values,
and values no column can hold together fail naming the field, never dropped or cast."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pytest

from microbatch.checkpoint import Layout
from microbatch.errors import SinkError
from microbatch.settings import Settings
from microbatch.sinks import ParquetSink
from microbatch.sinks import parquet as ps
from microbatch.sinks.base import StageContext, rows_to_table
from microbatch.storage import open_store


def stage_context(tmp_path: Path, batch_id: int, instance: int) -> StageContext:
    checkpoints = open_store(str(tmp_path / "checkpoints"))
    ctx = StageContext("orders", batch_id, instance, Settings(), checkpoints, Layout(), "a1")
    checkpoints.put(ctx.layout.plan_key(batch_id), b"{}")
    return ctx


def test_a_field_the_first_record_lacks_is_kept_with_nulls_where_absent() -> None:
    # An unmatched left-join row first: the right side's fields are absent from it.
    records = [
        {"order": 1, "user": "u1"},
        {"order": 2, "user": "u2", "city": "Oslo", "zip": 150},
        {"user": "u3", "order": 3, "city": "Rome"},
    ]

    table = rows_to_table("orders", records, None)

    assert table.column_names == ["order", "user", "city", "zip"]
    assert table.schema.field("zip").type == pa.int64()
    assert table.to_pylist() == [
        {"order": 1, "user": "u1", "city": None, "zip": None},
        {"order": 2, "user": "u2", "city": "Oslo", "zip": 150},
        {"order": 3, "user": "u3", "city": "Rome", "zip": None},
    ]


def test_records_with_the_first_records_fields_give_pyarrows_own_table() -> None:
    """The fast path (no field beyond the first record's) is pyarrow's ``from_pylist``:
    the same table, column order and all, as before inference took the union."""
    records = [
        {"user": "u1", "clicks": 1, "score": 0.5, "tags": ["a"]},
        {"clicks": 2, "user": "u2", "score": 1, "tags": []},
        {"user": "u3", "clicks": None},  # missing fields are nulls, as they were
    ]

    table = rows_to_table("clicks", records, None)

    assert table.equals(pa.Table.from_pylist(records))
    assert table.column_names == ["user", "clicks", "score", "tags"]
    assert table.schema.field("score").type == pa.float64()  # ints and floats: float64


def test_nested_records_keep_their_fields_too() -> None:
    records = [{"id": 1}, {"id": 2, "address": {"city": "Oslo"}}, {"id": 3, "address": {"zip": 7}}]

    table = rows_to_table("people", records, None)

    assert table.column("address").to_pylist() == [
        None,
        {"city": "Oslo", "zip": None},
        {"city": None, "zip": 7},
    ]


def test_a_field_with_an_int_and_a_string_fails_naming_the_field_and_both_types() -> None:
    records = [{"id": 1, "amount": 10}, {"id": 2}, {"id": 3, "amount": "ten", "note": "x"}]

    with pytest.raises(SinkError) as raised:
        rows_to_table("payments", records, None, "pipeline 'p' batch 4 instance 2")

    message = str(raised.value)
    assert message.startswith("pipeline 'p' batch 4 instance 2 sink 'payments': field 'amount'")
    assert "int64 in record 0" in message and "string in record 2" in message
    assert "declare the sink's schema" in message


def test_a_conflict_on_the_fast_path_names_the_field_as_well() -> None:
    with pytest.raises(SinkError, match=r"field 'flag' has incompatible types: bool in record 0"):
        rows_to_table("flags", [{"flag": True}, {"flag": None}, {"flag": 3}], None)


def test_an_int_a_float_cannot_hold_exactly_is_refused_not_rounded() -> None:
    with pytest.raises(SinkError, match=r"field 'n'.*exactly representable"):
        rows_to_table("big", [{"n": 0.5}, {"n": 2**60 + 1}], None)


def test_a_record_that_is_not_a_dict_is_named() -> None:
    with pytest.raises(SinkError, match=r"sink 'odd': record 1 is a int, not a dict"):
        rows_to_table("odd", [{"a": 1}, 7], None)


def test_parquet_files_with_different_fields_read_back_with_nothing_lost(tmp_path: Path) -> None:
    """Through the sink: each instance's file has the fields its records have, the error
    names the pipeline, batch and instance, and the reader nulls what a file lacks."""
    sink = ParquetSink("orders", str(tmp_path / "out"))
    first = sink.stage(stage_context(tmp_path, 0, 0), [{"id": 1}, {"id": 2, "city": "Oslo"}])
    second = sink.stage(stage_context(tmp_path, 0, 1), [{"id": 3, "zip": 150, "price": 2}])
    third = sink.stage(stage_context(tmp_path, 1, 0), [{"id": 4, "price": 2.5}])
    assert first is not None and second is not None and third is not None
    out = open_store(str(tmp_path / "out"))
    ps.publish_parquet(out, 0, [first, second], pipeline="orders")
    ps.publish_parquet(out, 1, [third], pipeline="orders")

    table = ps.read_parquet_sink(str(tmp_path / "out"))

    assert table.column_names == ["id", "city", "zip", "price"]
    assert table.schema.field("price").type == pa.float64()  # an int file next to a float one
    assert table.to_pylist() == [
        {"id": 1, "city": None, "zip": None, "price": None},
        {"id": 2, "city": "Oslo", "zip": None, "price": None},
        {"id": 3, "city": None, "zip": 150, "price": 2.0},
        {"id": 4, "city": None, "zip": None, "price": 2.5},
    ]
    with pytest.raises(SinkError, match=r"pipeline 'orders' batch 2 instance 3 sink 'orders'"):
        sink.stage(stage_context(tmp_path, 2, 3), [{"id": 5}, {"id": "five"}])


def test_files_whose_inferred_types_clash_are_a_sink_error_on_read(tmp_path: Path) -> None:
    sink = ParquetSink("orders", str(tmp_path / "out"))
    ints = sink.stage(stage_context(tmp_path, 0, 0), [{"code": 1}])
    strings = sink.stage(stage_context(tmp_path, 0, 1), [{"code": "A1"}])
    assert ints is not None and strings is not None
    ps.publish_parquet(open_store(str(tmp_path / "out")), 0, [ints, strings], pipeline="orders")

    with pytest.raises(SinkError, match=r"do not share one schema .*code.*declare the sink's"):
        ps.read_parquet_sink(str(tmp_path / "out"))
