"""The issue's payments job as one dataflow (shipped to Spark workers by value), and its
plain-Python reference.

source → merchant-risk enrichment (async I/O) → filter(amount > 0) → key_by(card) →
hopping windows of risky spend (20 s, every 10 s) → key_by(key) → alerts: a window whose
risky spend passes 100 raises one unless the card is quiet after an earlier alert; a
timer reports when the quiet period ends → and, from the filtered payments,
key_by(merchant) → running count, takings and risky takings per merchant.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from microbatch import windows
from microbatch.dataflow import Dataflow
from microbatch.enrich import AsyncOperator, NoRetry
from microbatch.runtime import (
    DeadLetterSink,
    Enrichment,
    EventTime,
    KafkaSource,
    KeyedProcessFunction,
    ParquetSink,
    Pipeline,
    ProcessContext,
)

RISKY_FROM = 50  # a merchant's risk (0-99) from which its takings are risky
WINDOW_MS, EVERY_MS = 20_000, 10_000
ALERT_AT = 100
QUIET_MS = 25_000


def risk_of(merchant: str) -> int:
    return int(merchant[1:]) * 37 % 100


async def merchant_risk(payment: dict[str, Any]) -> dict[str, Any]:
    risk = risk_of(payment["merchant"])
    return {**payment, "risk": risk, "risky": payment["amount"] if risk >= RISKY_FROM else 0}


def risk_operator() -> AsyncOperator:
    return AsyncOperator(merchant_risk, mode="ordered", capacity=50, timeout_s=None,
                         retry=NoRetry(), on_failure="fail")  # fmt: skip


class SpendAlerts(KeyedProcessFunction):
    def process(self, key: Any, records: Sequence[Any], ctx: ProcessContext) -> None:
        quiet = ctx.value("quiet_until")
        for w in records:
            if w["sum_risky"] > ALERT_AT and w["window_end"] >= quiet.get(0):
                quiet.set(w["window_end"] + QUIET_MS)
                ctx.register_timer(w["window_end"] + QUIET_MS)
                alert = {"card": key, "window_end": w["window_end"], "risky": w["sum_risky"]}
                ctx.emit(alert, to="alerts")

    def on_timer(self, key: Any, timestamp_ms: int, ctx: ProcessContext) -> None:
        ctx.emit({"card": key, "quiet_until": timestamp_ms}, to="quiet")


class MerchantTotals(KeyedProcessFunction):
    def process(self, key: Any, records: Sequence[Any], ctx: ProcessContext) -> None:
        totals = ctx.value("totals")
        count, taken, risky = totals.get([0, 0, 0])
        count += len(records)
        taken += sum(p["amount"] for p in records)
        risky += sum(p["risky"] for p in records)
        totals.set([count, taken, risky])
        ctx.emit({"merchant": key, "count": count, "sum": taken, "risky": risky})


def risky_payments(topic: str, root: str, *, max_records: int | None = None) -> Pipeline:
    flow = Dataflow(
        "risky-payments",
        checkpoints=f"{root}/checkpoints",
        event_time=EventTime(field="ts", idle_timeout_s=None),
        dead_letters=DeadLetterSink(path=f"{root}/dead"),
        max_parallelism=16,
        parallelism=2,
    )
    payments = (
        flow.source(KafkaSource(topics=(topic,), max_records_per_batch=max_records))
        .enrich(Enrichment(risk_operator))
        .filter(lambda p: p["amount"] > 0, name="no-refunds")
    )
    spend = windows.hopping(f"{WINDOW_MS}ms", every=f"{EVERY_MS}ms").sum("risky").final()
    per_card = payments.key_by("card").window(spend, uid="card-spend")
    per_card.to(ParquetSink("windows", f"{root}/windows"))
    per_card.key_by("key").process(
        SpendAlerts(),
        uid="card-alerts",
        outputs=[ParquetSink("alerts", f"{root}/alerts"), ParquetSink("quiet", f"{root}/quiet")],
    )
    payments.key_by("merchant").process(MerchantTotals(), uid="merchants").to(
        ParquetSink("merchants", f"{root}/merchants")
    )
    return flow.build()


def payment(i: int) -> bytes:
    amount = -7 if i % 9 == 0 else 20 + (i * 37) % 100
    body = {"card": f"c{i % 5}", "merchant": f"m{i % 4}", "amount": amount}
    return json.dumps({**body, "ts": 1_000 * i}).encode()


def reference(values: Sequence[bytes], watermark: int) -> dict[str, Any]:
    """What the dataflow must output once every value is read and the watermark is
    ``watermark``: the closed windows, the alerts and quiet periods they make, and each
    merchant's final totals."""
    payments = []
    for v in values:
        try:
            p = json.loads(v)
        except ValueError:
            continue
        if p["amount"] > 0:
            risk = risk_of(p["merchant"])
            payments.append({**p, "risky": p["amount"] if risk >= RISKY_FROM else 0})
    sums: dict[tuple[str, int], int] = {}
    for p in payments:
        latest = p["ts"] - p["ts"] % EVERY_MS
        for start in range(latest, p["ts"] - WINDOW_MS, -EVERY_MS):
            sums[(p["card"], start)] = sums.get((p["card"], start), 0) + p["risky"]
    closed = sorted(
        (c, s, s + WINDOW_MS, n) for (c, s), n in sums.items() if s + WINDOW_MS <= watermark
    )
    alerts, quiet, quiet_until = [], [], {}
    for card, _, end, risky in closed:
        if risky > ALERT_AT and end >= quiet_until.get(card, 0):
            quiet_until[card] = end + QUIET_MS
            alerts.append({"card": card, "window_end": end, "risky": risky})
            if end + QUIET_MS <= watermark:
                quiet.append({"card": card, "quiet_until": end + QUIET_MS})
    merchants: dict[str, dict[str, int]] = {}
    for p in payments:
        m = merchants.setdefault(p["merchant"], {"count": 0, "sum": 0, "risky": 0})
        m["count"] += 1
        m["sum"] += p["amount"]
        m["risky"] += p["risky"]
    return {
        "windows": [
            {"key": c, "window_start": s, "window_end": e, "sum_risky": n} for c, s, e, n in closed
        ],
        "alerts": sorted(alerts, key=lambda a: (a["card"], a["window_end"])),
        "quiet": sorted(quiet, key=lambda q: (q["card"], q["quiet_until"])),
        "merchants": dict(sorted(merchants.items())),
    }
