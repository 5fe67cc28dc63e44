"""Window aggregates give the same results however the records are split into batches,
and equal a plain-Python computation."""

from __future__ import annotations

import random
import statistics

import pyarrow as pa
import pytest

from microbatch.errors import ConfigError
from microbatch.windows.aggregate import (
    KEY,
    ORDER,
    START,
    TS,
    Collect,
    Count,
    Custom,
    First,
    Last,
    Max,
    Mean,
    Min,
    Sum,
    check_aggregates,
    merge_partials,
    partials,
    results,
)

AGGREGATES = [
    Count("n"),
    Sum("total", "v"),
    Min("low", "v"),
    Max("high", "v"),
    Mean("avg", "v"),
    First("first", "v"),
    Last("last", "v"),
    Collect("all", "v"),
    Custom(
        "sq",
        "v",
        init=lambda: 0,
        add=lambda a, v: a + v * v,
        combine=lambda a, b: a + b,
        finish=lambda a: a,
    ),
]


def records(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [
        {
            KEY: rng.choice("abc"),
            START: rng.choice([0, 60_000]),
            TS: rng.randrange(60_000),
            ORDER: i,
            "v": rng.randrange(100),
        }
        for i in range(n)
    ]


def in_batches(rows: list[dict], cuts: list[int]) -> dict:
    state: dict = {}
    for lo, hi in zip([0, *cuts], [*cuts, len(rows)], strict=True):
        if hi <= lo:
            continue
        for window, partial in partials(pa.Table.from_pylist(rows[lo:hi]), AGGREGATES).items():
            state[window] = merge_partials(AGGREGATES, state.get(window), partial)
    return {w: results(AGGREGATES, p) for w, p in state.items()}


def reference(rows: list[dict]) -> dict:
    out = {}
    for window in {(r[KEY], r[START]) for r in rows}:
        mine = sorted(
            (r for r in rows if (r[KEY], r[START]) == window), key=lambda r: (r[TS], r[ORDER])
        )
        vs = [r["v"] for r in mine]
        out[window] = {
            "n": len(vs), "total": sum(vs), "low": min(vs), "high": max(vs),
            "avg": statistics.fmean(vs), "first": vs[0], "last": vs[-1], "all": vs,
            "sq": sum(v * v for v in vs),
        }  # fmt: skip
    return out


def test_one_batch_equals_plain_python() -> None:
    rows = records(500)
    got = in_batches(rows, [])
    want = reference(rows)
    assert got.keys() == want.keys()
    for w in want:
        assert got[w].pop("avg") == pytest.approx(want[w].pop("avg"))
        assert got[w] == want[w]


def test_any_split_into_batches_gives_the_same_results() -> None:
    rows = records(500, seed=3)
    whole = in_batches(rows, [])
    for cuts in ([1], [250], [17, 99, 300, 499], list(range(0, 500, 7))):
        assert in_batches(rows, cuts) == whole


def test_aggregates_that_cannot_work_are_refused_when_built() -> None:
    with pytest.raises(ConfigError, match="same output name"):
        check_aggregates([Count("n"), Sum("n", "v")], None)
    with pytest.raises(ConfigError, match="'total' reads column 'amount'"):
        check_aggregates([Sum("total", "amount")], ["v", "ts"])
    with pytest.raises(ConfigError, match="needs a column"):
        check_aggregates([Sum("total")], None)
    with pytest.raises(ConfigError, match="needs init"):
        Custom("c", "v", add=lambda a, v: a)
