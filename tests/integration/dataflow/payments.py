"""A payments dataflow the dataflow tests run (shipped to Spark workers by value), and
its plain-Python reference.

source → filter(amount > 0) → map(cents) → key_by(card) → "spend": running total per
card, an alert (side output) the first time a card's total passes 1,000, a timer 30 s
after each payment that reports the card idle (side output; card c6 stops paying
half-way) → key_by(merchant) → "merchant": running count and sum per merchant.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from microbatch.dataflow import Dataflow
from microbatch.runtime import (
    DeadLetterSink,
    EventTime,
    KafkaSource,
    KeyedProcessFunction,
    ParquetSink,
    Pipeline,
    ProcessContext,
)

ALERT_AT = 1_000
IDLE_MS = 30_000


class SpendPerCard(KeyedProcessFunction):
    def process(self, key: Any, records: Sequence[Any], ctx: ProcessContext) -> None:
        total = ctx.value("total")
        alerted = ctx.value("alerted")
        for r in records:
            total.set(total.get(0) + r["amount"])
            ctx.emit({**r, "card_total": total.get()})
            if total.get() > ALERT_AT and not alerted.get(False):
                alerted.set(True)
                ctx.emit({"card": key, "total": total.get(), "at": r["ts"]}, to="alerts")
            ctx.register_timer(r["ts"] + IDLE_MS)

    def on_timer(self, key: Any, timestamp_ms: int, ctx: ProcessContext) -> None:
        if max(ctx.timers(), default=0) <= timestamp_ms:  # no later payment
            ctx.emit({"card": key, "idle_since": timestamp_ms}, to="idle")


class MerchantTotals(KeyedProcessFunction):
    def process(self, key: Any, records: Sequence[Any], ctx: ProcessContext) -> None:
        count, total = ctx.value("count"), ctx.value("sum")
        count.set(count.get(0) + len(records))
        total.set(total.get(0) + sum(r["amount"] for r in records))
        ctx.emit({"merchant": key, "count": count.get(), "sum": total.get()})


def with_cents(record: dict[str, Any]) -> dict[str, Any]:
    return {**record, "cents": record["amount"] * 100}


def payments_dataflow(topic: str, root: str, *, parallelism: int = 2) -> Pipeline:
    flow = Dataflow(
        "payments",
        checkpoints=f"{root}/checkpoints",
        event_time=EventTime(field="ts", idle_timeout_s=None),
        dead_letters=DeadLetterSink(path=f"{root}/dead"),
        max_parallelism=16,
        parallelism=parallelism,
    )
    spend = (
        flow.source(KafkaSource(topics=(topic,)))
        .filter(lambda p: p["amount"] > 0)
        .map(with_cents)
        .key_by("card")
        .process(
            SpendPerCard(),
            uid="spend",
            outputs=[ParquetSink("alerts", f"{root}/alerts"), ParquetSink("idle", f"{root}/idle")],
        )
    )
    spend.map(lambda r: {"card": r["card"], "ts": r["ts"], "total": r["card_total"]}).to(
        ParquetSink("charges", f"{root}/charges")
    )
    spend.key_by("merchant").process(MerchantTotals(), uid="merchant").to(
        ParquetSink("merchants", f"{root}/merchants")
    )
    return flow.build()


def payment(i: int, cards: int = 7, merchants: int = 3) -> bytes:
    amount = -5 if i % 11 == 0 else 40 + (i * 37) % 300
    card = i % cards if i < 60 or i % cards != 6 else 5
    body = {"card": f"c{card}", "merchant": f"m{i % merchants}", "amount": amount}
    return json.dumps({**body, "ts": 1_000 * i}).encode()


def reference(values: Sequence[bytes]) -> dict[str, Any]:
    """What the dataflow must output, computed in plain Python: charges, alerts, and the
    final count and sum per merchant (cards' payments are in order: one partition each)."""
    totals: dict[str, int] = {}
    charges, alerts = [], []
    merchants: dict[str, list[int]] = {}
    for v in values:
        try:
            p = json.loads(v)
        except ValueError:
            continue
        if p["amount"] <= 0:
            continue
        before = totals.get(p["card"], 0)
        totals[p["card"]] = before + p["amount"]
        charges.append({"card": p["card"], "ts": p["ts"], "total": totals[p["card"]]})
        if before <= ALERT_AT < totals[p["card"]]:
            alerts.append({"card": p["card"], "total": totals[p["card"]], "at": p["ts"]})
        m = merchants.setdefault(p["merchant"], [0, 0])
        m[0] += 1
        m[1] += p["amount"]
    return {
        "charges": sorted(charges, key=lambda r: (r["card"], r["ts"])),
        "alerts": sorted(alerts, key=lambda r: r["card"]),
        "merchants": {k: {"count": c, "sum": s} for k, (c, s) in sorted(merchants.items())},
    }
