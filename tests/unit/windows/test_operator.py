"""The window operator over several batches equals a plain-Python computation: late
records are set aside, every window is emitted once, and state keeps open windows only."""

from __future__ import annotations

import collections
import random

import pyarrow as pa

from microbatch.windows import Count, Hopping, Max, Session, Sum, Tumbling
from microbatch.windows.aggregate import KEY, ORDER, TS
from microbatch.windows.operator import WindowOperator

MIN = 60_000


def events(n: int, seed: int) -> list[dict]:
    """Mostly in order, some out of order by up to 3 minutes."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        t = i * 2_000 - rng.choice([0, 0, 0, rng.randrange(3 * MIN)])
        out.append(
            {KEY: rng.choice(["a", "b", "c"]), TS: max(t, 0), ORDER: i, "v": rng.randrange(50)}
        )
    return out


def run(
    op: WindowOperator, batches: list[list[dict]], watermarks: list[int]
) -> tuple[list, list, list]:
    state: dict = {}
    emitted, late, sizes = [], [], []
    before = None
    for batch, after in zip(batches, watermarks, strict=True):
        outcome = op.run(pa.Table.from_pylist(batch), state, before, after)
        emitted += outcome.rows
        late += [batch[i] for i in outcome.late]
        sizes.append(sum(len(w) for w in state.values()))
        before = after
    return emitted, late, sizes


def split(rows: list[dict], n: int) -> list[list[dict]]:
    size = -(-len(rows) // n)
    return [rows[i : i + size] for i in range(0, len(rows), size)]


def test_tumbling_count_and_sum_over_batches_equal_plain_python() -> None:
    rows = events(300, seed=1)
    batches = split(rows, 4)
    watermarks = [max(r[TS] for r in b) - MIN for b in batches[:-1]] + [10**12]
    op = WindowOperator(Tumbling("1m"), (Count("n"), Sum("total", "v")))

    emitted, late, sizes = run(op, batches, watermarks)

    expected_late, windows = [], collections.defaultdict(list)
    before = None
    for batch, after in zip(batches, watermarks, strict=True):
        for r in batch:
            start = r[TS] - r[TS] % MIN
            if before is not None and start + MIN <= before:
                expected_late.append(r)
            else:
                windows[r[KEY], start].append(r["v"])
        before = after
    assert late == expected_late and late  # the test has late records
    assert sorted((e["key"], e["window_start"], e["n"], e["total"]) for e in emitted) == sorted(
        (k, s, len(vs), sum(vs)) for (k, s), vs in windows.items()
    )
    assert all(e["window_end"] == e["window_start"] + MIN for e in emitted)
    assert sizes[-1] == 0  # every window emitted and forgotten
    assert max(sizes) <= 3 * 6  # only open windows: ~3 keys x the few minutes still open


def test_hopping_max_emits_every_window_of_every_record_once() -> None:
    rows = events(200, seed=2)
    op = WindowOperator(Hopping("3m", every="1m"), (Max("high", "v"),))

    emitted, late, _ = run(op, split(rows, 3), [0, 0, 10**12])

    windows = collections.defaultdict(list)
    for r in rows:
        for start in range(r[TS] - r[TS] % MIN - 2 * MIN, r[TS] + 1, MIN):
            if start <= r[TS] < start + 3 * MIN:
                windows[r[KEY], start].append(r["v"])
    assert not late
    assert sorted((e["key"], e["window_start"], e["high"]) for e in emitted) == sorted(
        (k, s, max(vs)) for (k, s), vs in windows.items()
    )


def test_sessions_spanning_batches_merge_into_one() -> None:
    rows = [
        {KEY: "a", TS: 0, ORDER: 0, "v": 1},
        {KEY: "a", TS: 50_000, ORDER: 1, "v": 1},  # next batch, within the 60 s gap
        {KEY: "a", TS: 200_000, ORDER: 2, "v": 1},  # a new session
        {KEY: "b", TS: 10_000, ORDER: 3, "v": 1},
    ]
    op = WindowOperator(Session("1m"), (Count("n"),))

    emitted, late, _ = run(op, [rows[:1], rows[1:2], rows[2:]], [None, None, 10**12])

    assert not late
    assert [(e["key"], e["window_start"], e["window_end"], e["n"]) for e in emitted] == [
        ("a", 0, 110_000, 2),
        ("a", 200_000, 260_000, 1),
        ("b", 10_000, 70_000, 1),
    ]


def test_updates_mode_emits_each_changed_window_every_batch() -> None:
    rows = [{KEY: "a", TS: 1_000, ORDER: 0, "v": 1}, {KEY: "a", TS: 2_000, ORDER: 1, "v": 1}]
    op = WindowOperator(Tumbling("1m"), (Count("n"),), mode="updates")

    emitted, _, sizes = run(op, [rows[:1], rows[1:], []], [0, 0, MIN])

    assert [e["n"] for e in emitted] == [1, 2, 2]  # batch 1, batch 2, then closed by batch 3
    assert sizes == [1, 1, 0]
