"""A batch's emitted rows are the same rows whether read as dicts or as one table."""

from __future__ import annotations

import random

import pyarrow as pa

from microbatch.windows.operator import BatchOutcome


def direct_and_held(seed: int) -> tuple[pa.Table, list[dict]]:
    """Windows no state held (a table) and windows state held (dicts), keys interleaved."""
    rng = random.Random(seed)
    rows = [
        {"key": k, "window_start": s, "window_end": s + 10, "count": rng.randint(1, 5)}
        for k in sorted(rng.sample(range(-500, 500), 60))
        for s in sorted(rng.sample(range(0, 100, 10), 3))
    ]
    direct = [r for r in rows if rng.random() < 0.6]
    held = [r for r in rows if r not in direct]
    return pa.Table.from_pylist(direct), held


def test_the_table_holds_the_rows_in_key_then_window_order() -> None:
    for seed in range(5):
        direct, held = direct_and_held(seed)
        outcome = BatchOutcome(held, [], direct)
        expected = sorted(held + direct.to_pylist(), key=lambda r: (r["key"], r["window_start"]))
        assert outcome.rows == expected
        columns = outcome.columns()
        assert columns is not None and columns.to_pylist() == expected
        assert len(outcome) == len(expected)


def test_held_rows_that_do_not_fit_the_columns_exactly_give_no_table() -> None:
    direct, held = direct_and_held(1)
    for odd in ({"count": 2.0}, {"count": float("nan")}, {"count": None, "extra": 1}):
        changed = [held[0] | odd, *held[1:]]
        outcome = BatchOutcome(changed, [], direct)
        assert outcome.columns() is None, odd  # the rows path keeps every value as it is
        assert changed[0] in outcome.rows


def test_rows_only_give_no_table_and_a_table_only_is_itself() -> None:
    direct, held = direct_and_held(2)
    assert BatchOutcome(held, []).columns() is None
    assert BatchOutcome([], [], direct).columns() is direct
    assert BatchOutcome([], [], direct).rows == direct.to_pylist()
