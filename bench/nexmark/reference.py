"""The queries in plain Python over the same events: what both engines must give.

Each function takes the events (iterables of dicts, read once, in any order) and the
watermark the run ends with (the largest event time of the query's topics minus the delay)
and returns the result as a sorted list of tuples in :data:`COLUMNS` order. A window
``[start, start + size)`` or an auction is in the result once the watermark reaches its
end (``end <= watermark``), as both engines emit them. Bids are only iterated (the 10M-event
set holds 9.2M), people and auctions may be held.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from .queries import HOP_MS, WINDOW_MS

Event = dict[str, Any]

#: Each query's result columns, in the order the functions return them.
COLUMNS = {
    "q0": ("auction", "bidder", "price", "channel", "url", "date_time", "extra"),
    "q1": ("auction", "bidder", "price", "date_time", "extra"),
    "q2": ("auction", "price"),
    "q3": ("name", "city", "state", "id"),
    "q4": ("category", "avg"),
    "q5": ("auction", "num", "window_start"),
    "q7": ("auction", "price", "bidder", "date_time", "extra"),
    "q8": ("id", "name", "starttime"),
}


def read_events(path: Path) -> Iterator[Event]:
    with path.open() as f:
        for line in f:
            yield json.loads(line)


def q0(bids: Iterable[Event]) -> list[tuple]:
    return sorted(tuple(b[c] for c in COLUMNS["q0"]) for b in bids)


def q1(bids: Iterable[Event]) -> list[tuple]:
    return sorted(
        (b["auction"], b["bidder"], b["price"] * 0.908, b["date_time"], b["extra"]) for b in bids
    )


def q2(bids: Iterable[Event]) -> list[tuple]:
    return sorted((b["auction"], b["price"]) for b in bids if b["auction"] % 123 == 0)


def q3(people: Iterable[Event], auctions: Iterable[Event]) -> list[tuple]:
    sellers = {p["id"]: p for p in people if p["state"] in ("or", "id", "ca")}
    return sorted(
        (p["name"], p["city"], p["state"], a["id"])
        for a in auctions
        if a["category"] == 10 and (p := sellers.get(a["seller"])) is not None
    )


def q4(auctions: Iterable[Event], bids: Iterable[Event], watermark: int) -> list[tuple]:
    """Per category, the average over auctions closed by ``watermark`` (``expires <=``) of
    each one's highest bid placed in ``[date_time, expires]`` (auctions without one left
    out)."""
    held = {a["id"]: a for a in auctions}
    best: dict[int, int] = {}
    for b in bids:
        a = held.get(b["auction"])
        if a is not None and a["date_time"] <= b["date_time"] <= a["expires"]:
            best[a["id"]] = max(best.get(a["id"], b["price"]), b["price"])
    finals: dict[int, list[int]] = defaultdict(list)
    for auction_id, price in best.items():
        a = held[auction_id]
        if a["expires"] <= watermark:
            finals[a["category"]].append(price)
    return sorted((c, sum(ps) / len(ps)) for c, ps in finals.items())


def q5(bids: Iterable[Event], watermark: int) -> list[tuple]:
    """Per closed 10 s window every 2 s, the auctions with the most bids."""
    counts: dict[int, dict[int, int]] = defaultdict(lambda: defaultdict(int))
    for b in bids:
        t = b["date_time"]
        start = t - t % HOP_MS
        while start > t - WINDOW_MS:
            counts[start][b["auction"]] += 1
            start -= HOP_MS
    out = []
    for start, per_auction in counts.items():
        if start + WINDOW_MS <= watermark:
            most = max(per_auction.values())
            out += [(a, n, start) for a, n in per_auction.items() if n == most]
    return sorted(out)


def q7(bids: Iterable[Event], watermark: int) -> list[tuple]:
    """Per closed 10 s tumbling window, the bids at its highest price."""
    tops: dict[int, tuple[int, list[Event]]] = {}
    for b in bids:
        start = b["date_time"] - b["date_time"] % WINDOW_MS
        price, held = tops.get(start, (b["price"], []))
        if b["price"] > price:
            price, held = b["price"], []
        if b["price"] == price:
            held.append(b)
        tops[start] = (price, held)
    return sorted(
        tuple(b[c] for c in COLUMNS["q7"])
        for start, (_, held) in tops.items()
        if start + WINDOW_MS <= watermark
        for b in held
    )


def q8(people: Iterable[Event], auctions: Iterable[Event], watermark: int) -> list[tuple]:
    """People who opened an auction in the 10 s window they joined in (closed windows)."""
    sellers = {(a["seller"], a["date_time"] - a["date_time"] % WINDOW_MS) for a in auctions}
    out = set()
    for p in people:
        start = p["date_time"] - p["date_time"] % WINDOW_MS
        if start + WINDOW_MS <= watermark and (p["id"], start) in sellers:
            out.add((p["id"], p["name"], start))
    return sorted(out)


#: Each query's reference and the kinds of events it takes, in its argument order
#: (``watermark`` follows when it takes one).
REFERENCES: dict[str, tuple[Any, tuple[str, ...], bool]] = {
    "q0": (q0, ("bid",), False),
    "q1": (q1, ("bid",), False),
    "q2": (q2, ("bid",), False),
    "q3": (q3, ("person", "auction"), False),
    "q4": (q4, ("auction", "bid"), True),
    "q5": (q5, ("bid",), True),
    "q7": (q7, ("bid",), True),
    "q8": (q8, ("person", "auction"), True),
}
