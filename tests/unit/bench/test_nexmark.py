"""Smoke test of the Nexmark bench's pure parts (bench/nexmark): the plain-Python
references on a handful of hand-made events, and the queries' own process functions run
through ProcessHarness against them. The bench itself (Kafka, Spark) is not run here."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench"))

from nexmark import queries, reference

from microbatch.testing import ProcessHarness, sided

WATERMARK = 25_000  # closes the windows [0, 10 s) and [10 s, 20 s), not auction 12


def person(id_: int, state: str, t: int) -> dict:
    return {"id": id_, "name": f"p{id_}", "city": "boise", "state": state, "date_time": t}


def auction(id_: int, seller: int, category: int, t: int, expires: int) -> dict:
    return {"id": id_, "seller": seller, "category": category, "date_time": t, "expires": expires}


def bid(auction_id: int, price: int, t: int) -> dict:
    return {"auction": auction_id, "bidder": 7, "price": price, "channel": "Apple",
            "url": "u", "date_time": t, "extra": ""}  # fmt: skip


PEOPLE = [person(1, "id", 1_000), person(2, "az", 2_000), person(3, "or", 12_000)]
AUCTIONS = [
    auction(10, 1, 10, 1_500, 8_000),
    auction(11, 2, 10, 2_500, 9_000),
    auction(12, 3, 11, 13_000, 30_000),  # still open at the watermark
    auction(13, 1, 11, 3_000, 5_000),
]
BIDS = [
    bid(10, 5, 2_000), bid(10, 9, 3_000), bid(10, 50, 9_000),  # the last after it closed
    bid(11, 7, 4_000),
    bid(13, 3, 4_500), bid(13, 100, 6_000),  # the highest of [0, 10 s), after 13 closed
    bid(12, 20, 14_000), bid(12, 20, 15_000),  # a tie in [10 s, 20 s)
]  # fmt: skip


def test_references_on_hand_made_events_give_hand_computed_results() -> None:
    assert reference.q2([bid(246, 4, 1), bid(247, 5, 2)]) == [(246, 4)]
    assert reference.q3(PEOPLE, AUCTIONS) == [("p1", "boise", "id", 10)]
    assert reference.q4(AUCTIONS, BIDS, WATERMARK) == [(10, 8.0), (11, 3.0)]
    assert [(b[0], b[1], b[3]) for b in reference.q7(BIDS, WATERMARK)] == [
        (12, 20, 14_000), (12, 20, 15_000), (13, 100, 6_000)]  # fmt: skip
    assert reference.q8(PEOPLE, AUCTIONS, WATERMARK) == [
        (1, "p1", 0), (2, "p2", 0), (3, "p3", 10_000)]  # fmt: skip
    hops = reference.q5([bid(1, 1, 1_000), bid(1, 1, 1_500), bid(2, 1, 2_500)], 100_000)
    assert hops == [(1, 2, s) for s in range(-8_000, 2_000, 2_000)] + [(2, 1, 2_000)]


def test_q4_functions_equal_the_reference() -> None:
    winning = ProcessHarness(queries.Winning())
    keyed = sided([(a["id"], a) for a in AUCTIONS], [(b["auction"], b) for b in BIDS])
    closed = winning.batch(keyed, watermark=WATERMARK).emitted
    averages = ProcessHarness(queries.Average()).batch([(c["category"], c) for c in closed])
    got = sorted((r["category"], r["avg"]) for r in averages.emitted)
    assert got == reference.q4(AUCTIONS, BIDS, WATERMARK)


def test_q4_bid_before_its_auction_waits_for_it() -> None:
    winning = ProcessHarness(queries.Winning())
    assert winning.batch(sided([], [(10, bid(10, 9, 3_000))]), watermark=2_000).emitted == ()
    out = winning.batch(sided([(10, AUCTIONS[0])], []), watermark=WATERMARK).emitted
    assert out == ({"category": 10, "final": 9},)


@pytest.mark.parametrize("batches", [1, 3])
def test_q7_functions_equal_the_reference(batches: int) -> None:
    best = ProcessHarness(queries.WindowBest())
    candidates: list[dict] = []
    for i in range(batches):  # the bids split over batches, the watermark at the end
        part = BIDS[i::batches]
        wm = WATERMARK if i == batches - 1 else 0
        candidates += best.batch([(b["auction"], b) for b in part], watermark=wm).emitted
    highest = ProcessHarness(queries.Highest())
    out = highest.batch([(c["window_start"], c) for c in candidates]).emitted
    columns = reference.COLUMNS["q7"]
    assert sorted(tuple(r[c] for c in columns) for r in out) == reference.q7(BIDS, WATERMARK)


def test_q5_hottest_keeps_every_auction_at_the_most() -> None:
    counts = [{"key": 1, "count": 3}, {"key": 2, "count": 5}, {"key": 3, "count": 5}]
    out = ProcessHarness(queries.Hottest()).batch([(0, c) for c in counts]).emitted
    assert out == ({"auction": 2, "num": 5, "window_start": 0},
                   {"auction": 3, "num": 5, "window_start": 0})  # fmt: skip


def test_an_empty_result_equals_an_empty_result_of_any_columns() -> None:
    """A query no window of which closed: microbatch's sink wrote no file (a table without
    columns), Spark's an empty typed one; the bench must call them equal, not crash."""
    import pyarrow as pa
    from nexmark.run import canonical

    columns = ("auction", "num")
    spark = pa.table({"auction": pa.array([], pa.int64()), "num": pa.array([], pa.int64())})
    assert canonical(pa.table({}), columns).equals(canonical(spark, columns))
    one = pa.table({"auction": [1], "num": [2]})
    assert not canonical(one, columns).equals(canonical(spark, columns))
