"""Local-global aggregation: partials of a batch's records computed in several parts (as
stage 1's tasks do), merged (as stage 2 does), give what one pass over all the records
gives — windows, late records, sessions, updates mode, first/last ties and nulls."""

from __future__ import annotations

import copy
import random

import pyarrow as pa
import pytest

from microbatch.state.codec import CodecError, decode_value
from microbatch.windows import (
    Collect,
    Count,
    Custom,
    First,
    Hopping,
    Last,
    Max,
    Mean,
    Min,
    Session,
    Sum,
    Tumbling,
)
from microbatch.windows.aggregate import (
    KEY,
    ORDER,
    START,
    TS,
    merge_table,
    mergeable,
    partial_table,
    partial_values,
    partials,
    pre_aggregable,
)
from microbatch.windows.operator import WindowOperator
from microbatch.windows.python_merge import encode_accumulators, merge_rows

MIN = 60_000
MERGEABLE = (
    Count("n"),
    Sum("total", "v"),
    Min("low", "v"),
    Max("high", "v"),
    Mean("avg", "v"),
    First("first", "v"),
    Last("last", "v"),
)


def _top3(acc: list, v: int | None) -> list:
    return acc if v is None else sorted({*acc, v}, reverse=True)[:3]


#: Lawful custom aggregates (their results do not depend on how records are split), with
#: accumulators of several codec types, and ``collect``, next to column-wise ones.
PYTHON_MERGED = (
    Count("n"),
    Last("last", "v"),
    Collect("all", "v"),
    Custom(
        "squares", "v", init=lambda: 0, add=lambda a, v: a + (v or 0) ** 2,
        combine=lambda a, b: a + b, finish=lambda a: a, pre_aggregate=True,
    ),
    Custom(
        "top3", "v", init=list, add=_top3, combine=lambda a, b: sorted({*a, *b})[::-1][:3],
        finish=tuple, pre_aggregate=True,
    ),
    Custom(
        "stats", "v", init=lambda: {"nulls": 0, "odd": False},
        add=lambda a, v: {"nulls": a["nulls"] + (v is None), "odd": a["odd"] or (v or 0) % 2 == 1},
        combine=lambda a, b: {"nulls": a["nulls"] + b["nulls"], "odd": a["odd"] or b["odd"]},
        finish=lambda a: f"{a['nulls']}/{a['odd']}", pre_aggregate=True,
    ),
)  # fmt: skip
#: Associative and agreeing with ``add``, but not commutative: the value of the earliest
#: record — right only if stage 1 folds in event-time order and stage 2 combines the
#: tasks' accumulators in the order of their earliest records (not for sessions: a
#: fragment may join an open session that began later, see ``Custom``).
FIRST_SEEN = Custom(
    "first_seen", "v", init=list, add=lambda a, v: a or [v], combine=lambda a, b: a or b,
    finish=lambda a: a[0], pre_aggregate=True,
)  # fmt: skip


def events(n: int, seed: int, start: int = 0) -> list[dict]:
    """Out of order by up to 3 minutes, event times on a 1 s grid (ties are common),
    some null values."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        t = start + (i * 2_000 - rng.choice([0, 0, rng.randrange(3 * MIN)])) // 1_000 * 1_000
        v = None if rng.random() < 0.1 else rng.randrange(50)
        out.append({KEY: rng.choice("abc"), TS: max(t, 0), ORDER: i, "v": v})
    return out


def parts_of(rows: list[dict], n: int, seed: int) -> list[pa.Table]:
    """The rows dealt into ``n`` parts at random (each keeps its rows' order)."""
    rng = random.Random(seed)
    dealt: list[list[dict]] = [[] for _ in range(n)]
    for r in rows:
        dealt[rng.randrange(n)].append(r)
    return [pa.Table.from_pylist(p, schema=pa.Table.from_pylist(rows).schema) for p in dealt]


def test_only_aggregates_without_python_partials_merge_column_wise() -> None:
    assert mergeable(MERGEABLE)
    assert not mergeable([Count("n"), Collect("all", "v")])
    custom = Custom("c", "v", init=int, add=lambda a, v: a, combine=max, finish=int)
    assert not mergeable([custom])
    assert pre_aggregable([*MERGEABLE, *PYTHON_MERGED])
    ordered = Custom("c", "v", init=str, add=str.__add__, combine=str.__add__, finish=str)
    assert not pre_aggregable([Count("n"), ordered])  # not opted in: every record shuffled


def test_custom_partials_cross_as_encoded_accumulators_and_merge_like_the_column_wise() -> None:
    rows = [r | {START: r[TS] - r[TS] % MIN} for r in events(300, seed=4)]
    pieces_of_rows = parts_of(rows, 3, seed=5)
    pieces = [
        encode_accumulators(partial_table(p, PYTHON_MERGED), PYTHON_MERGED) for p in pieces_of_rows
    ]
    shipped = pieces[0]
    assert "v_list" in shipped.column_names  # collect's values travel as they are
    assert {"__acc_squares", "__acc_top3", "__acc_stats"} <= set(shipped.column_names)
    assert decode_value(shipped.column("__acc_stats")[0].as_py())["nulls"] >= 0
    merged = merge_rows(pa.concat_tables(pieces[::-1]), PYTHON_MERGED)
    assert merged == partials(pa.Table.from_pylist(rows), PYTHON_MERGED)

    unencodable = Custom(
        "s", "v", init=set, add=lambda a, v: a | {v}, combine=set.union, finish=len
    )
    with pytest.raises(CodecError, match="aggregate 's': its accumulator must be plain data"):
        encode_accumulators(partial_table(pieces_of_rows[0], [unencodable]), [unencodable])

    # the Python merge of column-wise aggregates is the group-by's
    plain = [partial_table(p, MERGEABLE) for p in parts_of(rows, 3, seed=5)]
    by_columns = partial_values(merge_table(pa.concat_tables(plain), MERGEABLE), MERGEABLE)
    assert merge_rows(pa.concat_tables(plain), MERGEABLE) == by_columns


@pytest.mark.parametrize("n_parts", [1, 2, 5])
def test_merged_partials_of_parts_equal_the_partials_of_all_records(n_parts: int) -> None:
    rows = [r | {START: r[TS] - r[TS] % MIN} for r in events(400, seed=n_parts)]
    whole = partials(pa.Table.from_pylist(rows), MERGEABLE)
    pieces = [partial_table(p, MERGEABLE) for p in parts_of(rows, n_parts, seed=7) if p.num_rows]
    shuffled = pa.concat_tables(random.Random(1).sample(pieces, len(pieces)))
    merged = partial_values(merge_table(shuffled, MERGEABLE), MERGEABLE)
    assert merged == whole
    assert any(p[5][2] is None for p in whole.values()), "a window whose first value is null"


def test_first_and_last_ties_in_event_time_go_by_source_order_across_parts() -> None:
    rows = [
        {KEY: "a", START: 0, TS: 5_000, ORDER: 3, "v": 30},
        {KEY: "a", START: 0, TS: 5_000, ORDER: 1, "v": 10},  # earliest by source order
        {KEY: "a", START: 0, TS: 9_000, ORDER: 2, "v": 20},
        {KEY: "a", START: 0, TS: 9_000, ORDER: 4, "v": 40},  # latest by source order
    ]
    schema = pa.Table.from_pylist(rows).schema
    for split in ([0, 3], [1, 2], [0, 2], [1, 3]):  # each part: two of the records
        a = [r for i, r in enumerate(rows) if i in split]
        b = [r for i, r in enumerate(rows) if i not in split]
        tables = [partial_table(pa.Table.from_pylist(p, schema=schema), MERGEABLE) for p in (b, a)]
        merged = partial_values(merge_table(pa.concat_tables(tables), MERGEABLE), MERGEABLE)
        assert [(p[5][2], p[6][2]) for p in merged.values()] == [(10, 40)], split


def batches_through(
    op: WindowOperator, batches: list[list[dict]], watermarks: list[int | None], n_parts: int
) -> tuple[list[dict], list[dict], dict]:
    """Each batch pre-aggregated in ``n_parts`` parts (0: no pre-aggregation, ``run``),
    merged into one state; the emitted rows, late records and the final state."""
    state: dict = {}
    emitted, late = [], []
    before = None
    for k, (batch, after) in enumerate(zip(batches, watermarks, strict=True)):
        if n_parts == 0:
            outcome = op.run(pa.Table.from_pylist(batch), state, before, after)
            late += [batch[i] for i in outcome.late]
        else:
            pieces = []
            for part in parts_of(batch, n_parts, seed=k):
                partial, late_rows = op.pre_aggregate(part, before, encode=True)
                late += [part.slice(i, 1).to_pylist()[0] for i in late_rows]
                pieces += [] if partial is None else [partial]
            merged = pa.concat_tables(pieces) if pieces else None
            outcome = op.merge(merged, state, after)
        emitted += outcome.rows
        before = after
    return emitted, sorted(late, key=lambda r: r[ORDER]), copy.deepcopy(state)


SPECS = {
    "tumbling final": WindowOperator(Tumbling("1m"), MERGEABLE, "final", 10_000),
    "hopping updates": WindowOperator(Hopping("3m", every="1m"), MERGEABLE, "updates"),
    "session final": WindowOperator(Session("4s"), MERGEABLE, "final"),
    "session updates": WindowOperator(Session("5s"), MERGEABLE, "updates", 5_000),
    "custom tumbling final": WindowOperator(
        Tumbling("1m"), (*PYTHON_MERGED, FIRST_SEEN), "final", 10_000
    ),
    "custom hopping updates": WindowOperator(
        Hopping("3m", every="1m"), (*PYTHON_MERGED, FIRST_SEEN), "updates"
    ),
    "custom session final": WindowOperator(Session("4s"), PYTHON_MERGED, "final"),
    "custom session updates": WindowOperator(Session("5s"), PYTHON_MERGED, "updates", 5_000),
}


@pytest.mark.parametrize("kind", sorted(SPECS))
def test_pre_aggregated_batches_equal_the_records_path_row_for_row(kind: str) -> None:
    op = SPECS[kind]
    batches = [events(150, seed=s, start=s * 150_000) for s in range(4)]
    for k, batch in enumerate(batches[1:]):  # late whatever the window: every window closed
        batch += [{KEY: key, TS: 1_000 * k, ORDER: 1_000 + k, "v": 1} for key in "ab"]
    watermarks: list[int | None] = [None, 300_000, 450_000, 10**12]

    want = batches_through(op, batches, watermarks, n_parts=0)
    assert want[1], "the test has late records"
    assert len(want[0]) > 20
    for n_parts in (1, 3):
        assert batches_through(op, batches, watermarks, n_parts) == want, n_parts
