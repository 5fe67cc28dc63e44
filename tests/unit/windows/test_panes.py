"""Hopping windows reduced per pane, and windows that open and close in one batch emitted
column-wise, give row for row — same values, same order, same late records — what a
plain-Python window over the records gives, batch by batch, in both modes."""

from __future__ import annotations

import collections
import random

import pyarrow as pa
import pytest

from microbatch.windows import Count, Hopping, Sum, Tumbling
from microbatch.windows.aggregate import END, KEY, ORDER, TS
from microbatch.windows.operator import WindowOperator
from tests.unit.windows.test_pre_aggregation import MERGEABLE

MIN = 60_000
AGGREGATES = MERGEABLE  # each aggregate of the window operator that merges column-wise


def events(n: int, seed: int, start: int, keys: list) -> list[dict]:
    """Out of order by up to 4 minutes, on a 1 s grid (ties), some null values, many
    keys (so that a batch has keys with open windows and keys without)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        t = start + (i * 1_500 - rng.choice([0, 0, rng.randrange(4 * MIN)])) // 1_000 * 1_000
        v = None if rng.random() < 0.1 else rng.randrange(-50, 50)
        out.append({KEY: rng.choice(keys), TS: max(t, 0), ORDER: seed * 10_000 + i, "v": v})
    return out


def reference(
    spec: Hopping | Tumbling, mode: str, lateness: int, batches: list, watermarks: list
) -> list[tuple[list[dict], list[dict]]]:
    """Per batch: the emitted rows in (key, start) order and the late records."""
    every = spec.every_ms if isinstance(spec, Hopping) else spec.size_ms
    size = spec.size_ms
    open_windows: dict = collections.defaultdict(list)  # (key, start) -> records
    out, before = [], None
    for batch, after in zip(batches, watermarks, strict=True):
        late, changed = [], set()
        for r in batch:
            newest = r[TS] - r[TS] % every
            starts = [s for s in range(newest - size + every, newest + 1, every)]
            kept = [s for s in starts if before is None or s + size + lateness > before]
            if not kept:
                late.append(r)
            for s in kept:
                open_windows[r[KEY], s].append(r)
                changed.add((r[KEY], s))
        rows = []
        for key, s in sorted(open_windows):
            closed = after is not None and s + size + lateness <= after
            if closed or (mode == "updates" and (key, s) in changed):
                rows.append(result(key, s, size, open_windows[key, s]))
            if closed:
                del open_windows[key, s]
        out.append((rows, late))
        before = after
    return out


def result(key: object, start: int, size: int, records: list[dict]) -> dict:
    values = [r["v"] for r in records if r["v"] is not None]
    by_time = sorted(records, key=lambda r: (r[TS], r[ORDER]))
    return {
        "key": key, "window_start": start, "window_end": start + size, "n": len(records),
        "total": sum(values) if values else None, "low": min(values, default=None),
        "high": max(values, default=None), "avg": sum(values) / len(values) if values else None,
        "first": by_time[0]["v"], "last": by_time[-1]["v"],
    }  # fmt: skip


def through(op: WindowOperator, batches: list, watermarks: list) -> list:
    state: dict = {}
    out, before = [], None
    for batch, after in zip(batches, watermarks, strict=True):
        outcome = op.run(pa.Table.from_pylist(batch), state, before, after)
        out.append((outcome.rows, [batch[i] for i in outcome.late]))
        before = after
    return out


CASES = {
    "hopping final": (Hopping("3m", every="1m"), "final", 0),
    "hopping updates, lateness": (Hopping("3m", every="1m"), "updates", 20_000),
    "hopping final, lateness": (Hopping("4m", every="2m"), "final", 50_000),
    "tumbling final": (Tumbling("1m"), "final", 10_000),
}


@pytest.mark.parametrize("keys", [list("abcdefghijklmnop"), list(range(-8, 9))])
@pytest.mark.parametrize("case", sorted(CASES))
def test_windows_equal_plain_python_row_for_row(case: str, keys: list) -> None:
    spec, mode, lateness = CASES[case]
    batches = [events(120, seed=s, start=s * 150_000, keys=keys) for s in range(5)]
    watermarks = [170_000, 320_000, 470_000, 620_000, 10**12]  # each batch's latest - 10 s
    op = WindowOperator(spec, AGGREGATES, mode, lateness)  # type: ignore[arg-type]

    got = through(op, batches, watermarks)
    want = reference(spec, mode, lateness, batches, watermarks)

    assert any(late for _, late in want), "the test has late records"
    assert sum(len(rows) for rows, _ in want) > 100
    assert got == want


def test_pane_partials_say_what_they_cover_and_a_float_sum_keeps_windows() -> None:
    rows = [{KEY: "a", TS: 65_000, ORDER: 0, "v": 1}, {KEY: "a", TS: 70_000, ORDER: 1, "v": 2}]
    op = WindowOperator(Hopping("3m", every="1m"), (Count("n"), Sum("total", "v")))

    partial, late = op.pre_aggregate(pa.Table.from_pylist(rows), None)
    assert partial is not None and not late
    assert partial.select([END, "__window_start", "__ts_count"]).to_pylist() == [
        {END: 2 * MIN, "__window_start": MIN, "__ts_count": 2}  # one pane, both records
    ]
    # its oldest window [-1m, 2m) closed at 125 s: per window, for the two still open
    partial, _ = op.pre_aggregate(pa.Table.from_pylist(rows), 125_000)
    assert partial is not None
    assert sorted(partial.column("__window_start").to_pylist()) == [0, MIN]
    assert set(pc_sub(partial)) == {3 * MIN}  # windows: END = start + size

    floats = [dict(r, v=float(r["v"])) for r in rows]
    assert not op.uses_panes(pa.Table.from_pylist(floats).schema)  # a float sum: per window
    partial, _ = op.pre_aggregate(pa.Table.from_pylist(floats), None)
    assert partial is not None and END not in partial.column_names and partial.num_rows == 3


def pc_sub(partial: pa.Table) -> list[int]:
    ends, starts = partial.column(END).to_pylist(), partial.column("__window_start").to_pylist()
    return [e - s for e, s in zip(ends, starts, strict=True)]
