"""Records that arrive as columns (a dataflow without keyed steps:
:mod:`microbatch.runtime.column_taps`) are staged as the same table the same records
would give as dicts: cast to the sink's schema, a missing column null, an extra one left
out; a sink that writes records (Kafka) gets them as records."""

from __future__ import annotations

from typing import Any

import pyarrow as pa
import pytest

from microbatch.errors import SinkError
from microbatch.sinks import DeltaSink, IcebergSink, ParquetSink, PostgresSink
from microbatch.sinks.base import Sink, StageContext, conformed, rows_to_table

SCHEMA = pa.schema([("auction", pa.int64()), ("price", pa.float64()), ("note", pa.string())])
COLUMNS = pa.table(
    {"auction": pa.array([7, 8], pa.int32()), "price": [1.5, 2.0], "extra": ["x", "y"]}
)


def test_columns_become_the_table_their_records_would_give() -> None:
    as_records = rows_to_table("out", COLUMNS.to_pylist(), SCHEMA)
    assert conformed("out", COLUMNS, SCHEMA).equals(as_records)


def test_without_a_schema_the_columns_are_kept_as_they_are() -> None:
    assert conformed("out", COLUMNS, None) is COLUMNS


def test_a_column_that_does_not_fit_names_the_sink_and_the_column() -> None:
    words = pa.table({"auction": ["seven"]})
    with pytest.raises(SinkError, match=r"sink 'out': column 'auction' \(string\)"):
        conformed("out", words, SCHEMA)


@pytest.mark.parametrize("sink_class", [ParquetSink, DeltaSink, PostgresSink, IcebergSink])
def test_table_sinks_stage_the_columns_conformed_to_their_schema(
    sink_class: type, monkeypatch: pytest.MonkeyPatch
) -> None:
    tables: list[pa.Table] = []
    monkeypatch.setattr(sink_class, "stage_table", lambda self, ctx, table: tables.append(table))
    sink = sink_class(**_settings_of(sink_class))
    sink.stage_columns(None, COLUMNS)
    assert tables[0].equals(rows_to_table("out", COLUMNS.to_pylist(), SCHEMA))


def _settings_of(sink_class: type) -> dict[str, Any]:
    where = {
        ParquetSink: {"url": "file:///unused"},
        DeltaSink: {"table_uri": "file:///unused"},
        IcebergSink: {"table": "db.out"},
        PostgresSink: {"table": "public.out", "key": ("auction",)},
    }[sink_class]
    return {"name": "out", "schema": SCHEMA, **where}


def test_a_sink_that_writes_records_gets_the_columns_as_records() -> None:
    seen: list[Any] = []

    class Records(ParquetSink):  # the base class's stage_columns, as a Kafka sink has
        stage_columns = Sink.stage_columns

        def stage(self, ctx: StageContext, rows: Any) -> None:
            seen.extend(rows)

    Records("out", "unused").stage_columns(None, COLUMNS)  # type: ignore[arg-type]
    assert seen == COLUMNS.to_pylist()
