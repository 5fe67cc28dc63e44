"""A window's output rows handed on column by column give the envelope rows, sink rows
and numbering of handing on the same rows one by one (``Router.emit_keyed_rows``) —
or nothing at all, when a row may be a dead letter and must take that path."""

from __future__ import annotations

import random
from typing import Any

import pyarrow as pa
import pytest

from microbatch import windows
from microbatch.dataflow import Dataflow
from microbatch.runtime import DeadLetterSink, EventTime, KafkaSource, KeyedProcessFunction
from microbatch.runtime import ParquetSink as Parquet
from microbatch.runtime.router import Router
from tests.unit.dataflow.test_router import handed_on

WINDOW = windows.hopping("10s", every="2s").count().final()


class Echo(KeyedProcessFunction):
    def process(self, key: Any, records: Any, ctx: Any) -> None: ...


def router(next_key: str = "window_start", tap: bool = False, time_field: str = "ts") -> Router:
    flow = Dataflow("hc", checkpoints="/tmp/hc", event_time=EventTime(field=time_field),
                    dead_letters=DeadLetterSink(path="/tmp/hc-dead"), max_parallelism=16,
                    parallelism=3)  # fmt: skip
    counts = flow.source(KafkaSource(topics=("t",))).key_by("auction").window(WINDOW, uid="w")
    if tap:
        counts.to(Parquet("all", "/tmp/hc-all"))
    counts.key_by(next_key).process(Echo(), uid="top").to(Parquet("o", "/tmp/hc-o"))
    return Router("w", flow.build(), None, 3, lambda *a, **k: None)


def rows_of(r: Router) -> list[dict[str, Any]]:
    """The envelope rows handed on, in the order the next step reads them."""
    rows = handed_on(r).to_pylist()
    return sorted(rows, key=lambda row: (row["topic"], row["partition"], row["offset"]))


def window_rows(n: int, seed: int, key: Any = None) -> pa.Table:
    rng = random.Random(seed)
    keys = sorted({(key or (lambda: rng.randrange(-(2**40), 2**40)))() for _ in range(n)})
    rows = []
    for k in keys:
        for start in sorted(rng.sample(range(0, 40_000, 2_000), rng.randint(1, 4))):
            rows.append({"key": k, "window_start": start, "window_end": start + 10_000,
                         "count": rng.randint(1, 9)})  # fmt: skip
    return pa.Table.from_pylist(rows)


@pytest.mark.parametrize("seed", range(4))
def test_int_keyed_rows_go_on_as_one_by_one_in_key_group_runs(seed: int) -> None:
    one, columns = router(), router()
    first, second = window_rows(300, seed), window_rows(50, seed + 100)
    one.emit_keyed_rows(first.to_pylist())
    one.emit_keyed_rows(second.to_pylist())
    assert columns.emit_columns(first)
    assert columns.emit_columns(second)  # numbered on from the first call's offsets
    assert rows_of(columns) == rows_of(one)
    assert len(rows_of(one)) == first.num_rows + second.num_rows


def test_rows_by_row_and_by_column_mix_in_one_numbering() -> None:
    one, mixed = router(), router()
    first, second = window_rows(100, 7), window_rows(100, 8)
    one.emit_keyed_rows(first.to_pylist())
    one.emit_keyed_rows(second.to_pylist())
    mixed.emit_keyed_rows(first.to_pylist())
    assert mixed.emit_columns(second)
    assert rows_of(mixed) == rows_of(one)


def test_string_keys_and_a_string_next_key_go_on_alike() -> None:
    rng = random.Random(3)
    table = window_rows(200, 3, key=lambda: f"k{rng.randrange(10**6)}-ü")
    table = table.append_column("owner", pa.array([f"o{i % 7}" for i in range(table.num_rows)]))
    one, columns = router("owner"), router("owner")
    one.emit_keyed_rows(table.to_pylist())
    assert columns.emit_columns(table)
    assert rows_of(columns) == rows_of(one)


def test_the_event_time_field_wins_over_the_window_s_last_millisecond() -> None:
    table = window_rows(50, 5)
    ts = [None if i % 3 else 5_000 + i for i in range(table.num_rows)]
    table = table.append_column("ts", pa.array(ts, pa.int64()))
    one, columns = router(), router()
    one.emit_keyed_rows(table.to_pylist())
    assert columns.emit_columns(table)
    got = rows_of(columns)
    assert got == rows_of(one)
    assert {r["event_ts"] for r in got} & {5_000 + i for i in range(0, table.num_rows, 3)}


def test_a_tap_of_the_window_gets_its_rows_in_the_row_path_s_order() -> None:
    table = window_rows(40, 9)
    one, columns = router(tap=True), router(tap=True)
    one.emit_keyed_rows(table.to_pylist())
    assert columns.emit_columns(table)
    assert columns.outputs["all"] == one.outputs["all"]
    assert sorted(map(str, one.outputs["all"])) == sorted(map(str, table.to_pylist()))
    assert rows_of(columns) == rows_of(one)


@pytest.mark.parametrize(
    "odd",
    [
        ("window_start", pa.array([None, 2_000], pa.int64())),  # a null next key
        ("window_start", pa.array([0.5, 2.0])),  # keys that are no keys
        ("window_start", pa.array([2**62, 0], pa.int64())),  # beyond the column-wise ints
        ("ts", pa.array(["2024-01-01T00:00:00Z", None])),  # an event time to convert
    ],
    ids=["null key", "float key", "huge int key", "text time"],
)
def test_rows_that_may_be_dead_letters_are_left_to_the_row_path(odd: tuple[str, pa.Array]) -> None:
    name, values = odd
    table = pa.table({"key": [1, 2], "window_start": [0, 2_000], "window_end": [10_000, 12_000],
                      "count": [3, 4]})  # fmt: skip
    if name in table.column_names:
        table = table.set_column(table.schema.get_field_index(name), name, values)
    else:
        table = table.append_column(name, values)
    r = router()
    assert not r.emit_columns(table)
    assert handed_on(r).num_rows == 0  # nothing handed on: the row path does it all


def test_a_window_key_beyond_the_column_wise_ints_is_left_to_the_row_path() -> None:
    table = pa.table({"key": [2**62, 1], "window_start": [0, 0], "window_end": [10_000] * 2,
                      "count": [1, 2]})  # fmt: skip
    r = router()
    assert not r.emit_columns(table)
    assert handed_on(r).num_rows == 0
