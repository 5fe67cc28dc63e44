"""The PostgreSQL sink's rows on their way to ``COPY``: one batch's staged tables as one,
the last row per key in key order, and PostgreSQL's CSV — all column-wise in Arrow."""

from __future__ import annotations

import io
from collections.abc import Sequence

import pyarrow as pa
import pyarrow.compute as pc


def concat(tables: Sequence[pa.Table], schema: pa.Schema) -> pa.Table:
    """The staged tables of a batch as one, in the sink's column order."""
    if not tables:
        return schema.empty_table()
    return pa.concat_tables([t.select(schema.names).cast(schema) for t in tables])


def last_per_key(rows: pa.Table, key: Sequence[str]) -> pa.Table:
    """The last row of each key (rows come in instance, then emission order), sorted by
    key: B-tree inserts in key order touch each index page once (~1.5x faster)."""
    n = rows.num_rows
    if n < 2:
        return rows
    keys = rows.select(list(key))
    # Arrow's sort is stable: equal keys keep their emission order, the last one last.
    order = pc.sort_indices(keys, sort_keys=[(k, "ascending") for k in key])
    sorted_keys = keys.take(order)
    changes = None  # row i differs from row i + 1 in some key column
    for k in key:
        col = sorted_keys.column(k)
        differs = pc.not_equal(col.slice(0, n - 1), col.slice(1))
        changes = differs if changes is None else pc.or_(changes, differs)
    assert changes is not None
    last = pa.concat_arrays([pa.chunked_array(changes).combine_chunks(), pa.array([True])])
    return rows.take(order.filter(last))


def csv_bytes(rows: pa.Table) -> bytes:
    """The rows as COPY's CSV: NULL unquoted-empty, text quoted, bytea as hex, lists as
    array literals (all in Arrow: no Python object per row but for bytea)."""
    import pyarrow.csv as pcsv

    for i, field in enumerate(rows.schema):
        if pa.types.is_binary(field.type) or pa.types.is_large_binary(field.type):
            hexed = pa.array(
                [None if v is None else "\\x" + v.hex() for v in rows.column(i).to_pylist()],
                pa.string(),
            )
            rows = rows.set_column(i, field.name, hexed)
        elif pa.types.is_list(field.type) or pa.types.is_large_list(field.type):
            rows = rows.set_column(i, field.name, array_literals(rows.column(i)))
    out = io.BytesIO()
    pcsv.write_csv(rows, out, pcsv.WriteOptions(include_header=False, quoting_style="needed"))
    return out.getvalue()


def array_literals(column: pa.ChunkedArray) -> pa.Array:
    """A list column as PostgreSQL array literals: ``{"a","b c",NULL}``, each element
    quoted with backslash and double quote escaped; a NULL list stays NULL."""
    lists = column.combine_chunks()
    if pa.types.is_large_list(lists.type):
        lists = lists.cast(pa.list_(lists.type.value_type))
    items = lists.values.cast(pa.string())
    escaped = pc.replace_substring(pc.replace_substring(items, "\\", "\\\\"), '"', '\\"')
    quoted = pc.binary_join_element_wise('"', escaped, '"', "")
    quoted = pc.if_else(pc.is_null(items), pa.scalar("NULL"), quoted)
    joined = pc.binary_join(pa.ListArray.from_arrays(lists.offsets, quoted), ",")
    literal = pc.binary_join_element_wise("{", joined, "}", "")
    return pc.if_else(pc.is_null(lists), pa.scalar(None, pa.string()), literal)
