"""Nexmark q0–q8 as microbatch dataflows: one function per query, each returning the
:class:`~microbatch.runtime.Pipeline` of a dataflow that reads the query's topics and
writes its result to the Parquet sink ``out`` under ``root``.

The queries follow Flink's Nexmark SQL (nexmark/nexmark), in event time (``date_time``,
epoch ms), with the watermark rule of Spark's ``withWatermark`` (``global_max``, delay
:data:`LATENESS_S`) so that both engines close the same windows. A result that depends on
the watermark — a window, an auction's close — is emitted once the watermark passes it:

- q0 passthrough; q1 price in euros (``price * 0.908``); q2 bids of auctions
  ``auction % 123 == 0``. No event time, no keyed step: with declared schemas
  (``Reading.schema``) each is source → ``where``/``select`` on the Arrow columns → sink
  (a dataflow without keyed steps); decoded per record, one keyed step without state
  (:class:`Each`, keyed by auction) after a record-wise filter.
- q3 local item suggestion: auctions of category 10 ⋈ their sellers in OR, ID or CA — a
  :class:`~microbatch.joins.TableJoin` (the sellers are the table: the generator only
  gives an auction a seller whose person event came before it), without event time (as
  Spark's q3 has no watermark): no time is read and none is kept in the table's state.
- q4 average closing price per category: auction ⋈ bid per auction (:class:`Winning`:
  the highest bid between the auction's ``date_time`` and ``expires``, emitted when the
  watermark passes ``expires``), re-keyed by category (:class:`Average`).
- q5 hot items: bids per auction in 10 s windows every 2 s (``windows.hopping``, run on
  columns), then per window the auctions with the most (:class:`Hottest`).
- q7 highest bid per 10 s window: per auction and window the bids at its highest price
  (:class:`WindowBest`, emitted when the window closes), then per window those at the
  highest of all (:class:`Highest`) — the join back to the bids, done where they are.
- q8 new users: people ⋈ the sellers of auctions in the same 10 s tumbling window — the
  auctions counted per seller and window, then a :class:`~microbatch.joins.WindowJoin`.

Windows close for every key at once (one watermark per pipeline), so a later step gets
all of a window's rows in one call: :class:`Hottest` and :class:`Highest` keep no state.

With declared schemas, q3, q4 and q8 filter (q3) and project each source on its Arrow
columns (``where``/``select``) before any record is built, so that only the rows kept,
with the fields the query reads, become records and cross the exchange.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from microbatch import windows
from microbatch.dataflow import Dataflow
from microbatch.joins import TableJoin, WindowJoin
from microbatch.joins import fields as join_fields
from microbatch.runtime import (
    EventTime,
    JsonSchema,
    KafkaSource,
    KeyedProcessFunction,
    ParquetSink,
    Pipeline,
    ProcessContext,
)

from .events import fields

WINDOW_MS, HOP_MS = 10_000, 2_000
LATENESS_S = 2
PARALLELISM, MAX_PARALLELISM = 2, 128
SCHEMAS = {kind: JsonSchema(fields(kind)) for kind in ("person", "auction", "bid")}


@dataclasses.dataclass(frozen=True)
class Topics:
    person: str
    auction: str
    bid: str


def new_flow(name: str, root: Path, timed: bool = True) -> Dataflow:
    event_time = EventTime(
        "date_time", allowed_lateness_s=LATENESS_S, idle_timeout_s=None, watermark="global_max"
    )
    return Dataflow(
        name,
        checkpoints=str(root / "checkpoints"),
        event_time=event_time if timed else None,
        max_parallelism=MAX_PARALLELISM,
        parallelism=PARALLELISM,
    )


@dataclasses.dataclass(frozen=True)
class Reading:
    """How a query reads its topics: ``schema`` decodes by the kind's declared schema into
    Arrow columns (else per record, ``json.loads``); ``max_records``: records per batch
    (None: everything in one batch)."""

    schema: bool = False
    max_records: int | None = None
    reader: str = "auto"


def source(topic: str, kind: str, reading: Reading) -> KafkaSource:
    """The topic through ``reading.reader`` (``"auto"``: the native reader)."""
    schema = SCHEMAS[kind] if reading.schema else None
    return KafkaSource(topics=(topic,), reader=reading.reader,  # type: ignore[arg-type]
                       value_schema=schema, max_records_per_batch=reading.max_records)  # fmt: skip


def out(root: Path) -> ParquetSink:
    return ParquetSink("out", str(root / "out"))


# Stateless per record: q0, q1, q2 ---------------------------------------------------------


class Each(KeyedProcessFunction):
    """``fn(record)`` of every record (``None``: nothing); no state."""

    def __init__(self, fn: Callable[[dict[str, Any]], dict[str, Any] | None]) -> None:
        self.fn = fn

    def process(self, key: Any, records: Sequence[Any], ctx: ProcessContext) -> None:
        fn, emit = self.fn, ctx.emit
        for record in records:
            if (result := fn(record)) is not None:
                emit(result)


def passthrough(bid: dict[str, Any]) -> dict[str, Any]:
    return bid


def in_euros(bid: dict[str, Any]) -> dict[str, Any]:
    return {"auction": bid["auction"], "bidder": bid["bidder"], "price": bid["price"] * 0.908,
            "date_time": bid["date_time"], "extra": bid["extra"]}  # fmt: skip


def q0(name: str, topics: Topics, root: Path, reading: Reading) -> Pipeline:
    flow = new_flow(name, root, timed=False)
    bids = flow.source(source(topics.bid, "bid", reading))
    if reading.schema:  # the columns straight to the sink
        bids.to(out(root))
    else:
        bids.key_by("auction").process(Each(passthrough), uid="q0").to(out(root))
    return flow.build()


#: Spark's ``price * 0.908``: the long price as a double, times a double.
EURO_RATE = pc.scalar(pa.scalar(0.908, pa.float64()))


def q1(name: str, topics: Topics, root: Path, reading: Reading) -> Pipeline:
    flow = new_flow(name, root, timed=False)
    bids = flow.source(source(topics.bid, "bid", reading))
    if reading.schema:
        euros = pc.field("price") * EURO_RATE
        bids.select("auction", "bidder", "date_time", "extra", price=euros).to(out(root))
    else:
        bids.key_by("auction").process(Each(in_euros), uid="q1").to(out(root))
    return flow.build()


def q2(name: str, topics: Topics, root: Path, reading: Reading) -> Pipeline:
    flow = new_flow(name, root, timed=False)
    bids = flow.source(source(topics.bid, "bid", reading))
    if reading.schema:  # auction % 123 == 0; integer division: exact (Arrow has no modulo)
        auction = pc.field("auction")
        bids.where(auction - auction / 123 * 123 == 0).select("auction", "price").to(out(root))
        return flow.build()
    bids.filter(lambda b: b["auction"] % 123 == 0).key_by("auction").process(
        Each(lambda b: {"auction": b["auction"], "price": b["price"]}), uid="q2"
    ).to(out(root))
    return flow.build()


# q3: a table join ---------------------------------------------------------------------------


SELLER_STATES = ("or", "id", "ca")


def q3(name: str, topics: Topics, root: Path, reading: Reading) -> Pipeline:
    flow = new_flow(name, root, timed=False)  # a table join needs no event time
    auctions = flow.source(source(topics.auction, "auction", reading))
    people = flow.source(source(topics.person, "person", reading))
    if reading.schema:  # filtered on the columns; records of the fields the join reads only
        auctions = auctions.where(pc.field("category") == 10).select("id", "seller")
        sellers = people.where(pc.field("state").isin(SELLER_STATES)).select(
            "id", "name", "city", "state"
        )
    else:
        auctions = auctions.filter(lambda a: a["category"] == 10)
        sellers = people.filter(lambda p: p["state"] in SELLER_STATES)
    # Output fields named, not computed: with declared schemas the join runs on columns.
    suggest = TableJoin(select=join_fields(left=["id"], right=["name", "city", "state"]))
    auctions.key_by("seller").join(sellers.key_by("id"), suggest, uid="q3").to(out(root))
    return flow.build()


# q4: auction ⋈ bid within the auction's life, then an average per category -----------------


class Winning(KeyedProcessFunction):
    """Per auction (side 0: the auction, 1: its bids): the highest bid placed between its
    ``date_time`` and ``expires``, emitted as ``{category, final}`` once the watermark
    passes ``expires``. Bids that come before their auction wait until it does (or until
    the watermark passes them: no auction that could take them is still to come). State
    keeps only what the result needs — ``[date_time, expires, category]`` of the auction,
    ``[date_time, price]`` of a waiting bid — as every state value is encoded and decoded
    field by field."""

    def process(self, key: Any, records: Sequence[Any], ctx: ProcessContext) -> None:
        auction, best, early = ctx.value("auction"), ctx.value("best"), ctx.list("early")
        bids = [(r.record["date_time"], r.record["price"]) for r in records if r.side == 1]
        a = None
        for side, record in records:
            if side == 0:
                a = [record["date_time"], record["expires"], record["category"]]
                auction.set(a)
                ctx.register_timer(record["expires"])
                bids += map(tuple, early.get())
                early.clear()
        if a is None and (a := auction.get()) is None:
            early.add_all([list(b) for b in bids])
            for t, _ in bids:
                ctx.register_timer(t)
            return
        start, expires = a[0], a[1]
        valid = [price for t, price in bids if start <= t <= expires]
        if valid:
            best.set(max(best.get(0), *valid))

    def on_timer(self, key: Any, timestamp_ms: int, ctx: ProcessContext) -> None:
        auction, best = ctx.value("auction"), ctx.value("best")
        if (a := auction.get()) is None:
            ctx.list("early").clear()  # bids whose auction never came in time
        elif timestamp_ms == a[1]:
            if (final := best.get()) is not None:
                ctx.emit({"category": a[2], "final": final})
            auction.clear()
            best.clear()


class Average(KeyedProcessFunction):
    """Per category: the running average of the closing prices; one row per batch."""

    def process(self, key: Any, records: Sequence[Any], ctx: ProcessContext) -> None:
        total, count = ctx.value("sum"), ctx.value("count")
        total.set(total.get(0) + sum(r["final"] for r in records))
        count.set(count.get(0) + len(records))
        ctx.emit({"category": key, "avg": total.get() / count.get(), "auctions": count.get()})


def q4(name: str, topics: Topics, root: Path, reading: Reading) -> Pipeline:
    flow = new_flow(name, root)
    auctions = flow.source(source(topics.auction, "auction", reading))
    bids = flow.source(source(topics.bid, "bid", reading))
    if reading.schema:  # only the fields Winning reads (and the keys) become records
        auctions = auctions.select("id", "date_time", "expires", "category")
        bids = bids.select("auction", "date_time", "price")
    closed = auctions.key_by("id").join(bids.key_by("auction"), Winning(), uid="q4-winning")
    closed.key_by("category").process(Average(), uid="q4-average").to(out(root))
    return flow.build()


# q5: hot items -----------------------------------------------------------------------------


class Hottest(KeyedProcessFunction):
    """Per window (the key): the auctions with the most bids, from the window's counts."""

    def process(self, key: Any, records: Sequence[Any], ctx: ProcessContext) -> None:
        most = max(r["count"] for r in records)
        for r in records:
            if r["count"] == most:
                ctx.emit({"auction": r["key"], "num": most, "window_start": key})


def q5(name: str, topics: Topics, root: Path, reading: Reading) -> Pipeline:
    flow = new_flow(name, root)
    bids = flow.source(source(topics.bid, "bid", reading))
    counts = bids.key_by("auction").window(
        windows.hopping(WINDOW_MS, every=HOP_MS).count().final(), uid="q5-counts"
    )
    counts.key_by("window_start").process(Hottest(), uid="q5-hottest").to(out(root))
    return flow.build()


# q7: highest bid per window -----------------------------------------------------------------


class WindowBest(KeyedProcessFunction):
    """Per key and 10 s tumbling window: the bids at its highest price (map state, window
    start → ``[price, bids]``), emitted with ``window_start`` when the window closes."""

    def process(self, key: Any, records: Sequence[Any], ctx: ProcessContext) -> None:
        state, tops = ctx.map("best"), {}
        for b in records:
            w = b["date_time"] - b["date_time"] % WINDOW_MS
            top = tops.get(w) or state.get(w) or [b["price"], []]
            if b["price"] > top[0]:
                top = [b["price"], []]
            if b["price"] == top[0]:
                top[1].append(b)
            tops[w] = top
        for w, top in tops.items():
            state.put(w, top)
            ctx.register_timer(w + WINDOW_MS)

    def on_timer(self, key: Any, timestamp_ms: int, ctx: ProcessContext) -> None:
        state, w = ctx.map("best"), timestamp_ms - WINDOW_MS
        for b in state.get(w, [0, []])[1]:
            ctx.emit({**b, "window_start": w})
        state.remove(w)


class Highest(KeyedProcessFunction):
    """Per window (the key): the bids at the highest price of its candidates."""

    def process(self, key: Any, records: Sequence[Any], ctx: ProcessContext) -> None:
        top = max(b["price"] for b in records)
        for b in records:
            if b["price"] == top:
                ctx.emit(b)


def q7(name: str, topics: Topics, root: Path, reading: Reading) -> Pipeline:
    flow = new_flow(name, root)
    bids = flow.source(source(topics.bid, "bid", reading))
    best = bids.key_by("auction").process(WindowBest(), uid="q7-auction-best")
    best.key_by("window_start").process(Highest(), uid="q7-highest").to(out(root))
    return flow.build()


# q8: new users --------------------------------------------------------------------------


#: Output fields named, not computed: the join runs on columns (the people's declared,
#: the window's rows as they come); it adds window_start and window_end.
NEW_USER = join_fields(left=["id", "name"], right={"starttime": "window_start"})


def q8(name: str, topics: Topics, root: Path, reading: Reading) -> Pipeline:
    flow = new_flow(name, root)
    people = flow.source(source(topics.person, "person", reading))
    auctions = flow.source(source(topics.auction, "auction", reading))
    if reading.schema:  # only what new_user and the window read travels
        people = people.select("id", "name", "date_time")
        auctions = auctions.select("seller", "date_time")
    sellers = auctions.key_by("seller").window(
        windows.tumbling(WINDOW_MS).count().final(), uid="q8-sellers"
    )
    joined = WindowJoin("date_time", "window_start", WINDOW_MS, select=NEW_USER)
    people.key_by("id").join(sellers.key_by("key"), joined, uid="q8").to(out(root))
    return flow.build()


#: Each query: its dataflow and the kinds of events it reads.
QUERIES: dict[str, tuple[Callable[..., Pipeline], tuple[str, ...]]] = {
    "q0": (q0, ("bid",)),
    "q1": (q1, ("bid",)),
    "q2": (q2, ("bid",)),
    "q3": (q3, ("person", "auction")),
    "q4": (q4, ("auction", "bid")),
    "q5": (q5, ("bid",)),
    "q7": (q7, ("bid",)),
    "q8": (q8, ("person", "auction")),
}
