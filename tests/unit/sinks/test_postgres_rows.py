"""The PostgreSQL sink's rows before COPY: the last row per key, and PostgreSQL's CSV."""

from __future__ import annotations

import pyarrow as pa

from microbatch.sinks.postgres_rows import array_literals, concat, csv_bytes, last_per_key

SCHEMA = pa.schema([("user", pa.string()), ("n", pa.int64())])


def table(rows: list[tuple[str, int]]) -> pa.Table:
    return pa.Table.from_pylist([{"user": u, "n": n} for u, n in rows], schema=SCHEMA)


def test_the_last_emitted_row_of_each_key_wins_and_rows_come_sorted_by_key() -> None:
    rows = concat([table([("b", 1), ("a", 2), ("b", 3)]), table([("a", 4), ("c", 5)])], SCHEMA)
    got = last_per_key(rows, ["user"]).to_pylist()
    assert got == [{"user": "a", "n": 4}, {"user": "b", "n": 3}, {"user": "c", "n": 5}]


def test_a_composite_key_compares_every_column() -> None:
    rows = table([("a", 1), ("a", 1), ("a", 2)]).append_column("v", pa.array([10, 11, 12]))
    assert last_per_key(rows, ["user", "n"]).column("v").to_pylist() == [11, 12]


def test_a_batch_of_many_rows_keeps_one_per_key_in_emission_order_per_key() -> None:
    rows = table([(f"u{i % 7}", i) for i in range(1000)])
    got = {r["user"]: r["n"] for r in last_per_key(rows, ["user"]).to_pylist()}
    assert got == {f"u{k}": max(i for i in range(1000) if i % 7 == k) for k in range(7)}


def test_csv_tells_null_from_empty_and_quotes_what_needs_it() -> None:
    rows = pa.table({"s": ["", None, 'a"b,c'], "i": [1, None, 3]})
    assert csv_bytes(rows) == b'"",1\n,\n"a""b,c",3\n'


def test_lists_become_array_literals_with_each_element_quoted() -> None:
    lists = pa.chunked_array([pa.array([["x", 'q"', "b\\s", None], [], None])])
    assert array_literals(lists).to_pylist() == ['{"x","q\\"","b\\\\s",NULL}', "{}", None]
    numbers = pa.chunked_array([pa.array([[1, None, 3]])])
    assert array_literals(numbers).to_pylist() == ['{"1",NULL,"3"}']
