"""The PostgreSQL sink's refused rows: which errors are a row's, where they go, and the
row as JSON in the refused table."""

from __future__ import annotations

import datetime as dt
import decimal
import json

import pytest

from microbatch.errors import ConfigError
from microbatch.sinks import PostgresSink
from microbatch.sinks.postgres_refused import (
    Refusal,
    is_refusal,
    refused_table_name,
    to_json,
)
from microbatch.sinks.postgres_schema import TableName


class _Error(Exception):
    def __init__(self, sqlstate: str | None) -> None:
        self.sqlstate = sqlstate


@pytest.mark.parametrize(
    ("sqlstate", "refused"),
    [("23514", True), ("23502", True), ("22021", True), ("22003", True),
     ("55P03", False), ("40001", False), ("08006", False), ("P0001", False), (None, False)],
)  # fmt: skip
def test_only_data_and_integrity_errors_are_a_rows_refusal(
    sqlstate: str | None, refused: bool
) -> None:
    assert is_refusal(_Error(sqlstate)) is refused


def test_the_refused_table_sits_next_to_the_sinks_table_unless_named() -> None:
    table = TableName("analytics", "totals")
    assert refused_table_name(table, "") == TableName("analytics", "totals_refused")
    assert refused_table_name(table, "bad") == TableName("analytics", "bad")
    assert refused_table_name(table, "audit.bad") == TableName("audit", "bad")


def test_a_refused_row_reads_back_from_its_json_exactly() -> None:
    row = {
        "at": dt.datetime(2026, 1, 2, 3, 4, 5, 6, tzinfo=dt.UTC),
        "day": dt.date(2026, 1, 2),
        "price": decimal.Decimal("-0.10"),
        "blob": b"\x00\xff",
        "text": "nul\x00é",
        "tags": ["a", None],
    }
    assert json.loads(to_json(row)) == {
        "at": "2026-01-02T03:04:05.000006+00:00",
        "day": "2026-01-02",
        "price": "-0.10",
        "blob": "AP8=",
        "text": "nul\x00é",
        "tags": ["a", None],
    }


def test_the_reason_names_column_and_constraint_when_postgres_does() -> None:
    check = Refusal(3, "23514", "positive", None, "new row violates", "Failing row (x).")
    assert check.reason() == "constraint 'positive': new row violates. Failing row (x)."
    null = Refusal(0, "23502", None, "clicks", "null value in column", None)
    assert null.reason() == "column 'clicks': null value in column."


def test_an_unknown_refusal_mode_or_a_refused_table_without_dead_letters_is_refused() -> None:
    import pyarrow as pa

    schema = pa.schema([pa.field("id", pa.int64(), nullable=False)])
    with pytest.raises(ConfigError, match=r"on_refused='skip'; use one of fail, dead_letter"):
        PostgresSink("out", "t", schema, key="id", on_refused="skip")
    with pytest.raises(ConfigError, match=r"refused_table is where on_refused='dead_letter'"):
        PostgresSink("out", "t", schema, key="id", refused_table="bad")
