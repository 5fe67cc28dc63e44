"""The payments job as one dataflow vs as two pipelines reading the topic twice.

Produces ``--records`` JSON payments ``{"card": "c<n % 2000>", "merchant": "m<n % 500>",
"amount": ..., "ts": ...}`` (1 ms apart) into a fresh 4-partition topic (every 13th a
refund, amount < 0). Then, on ONE SparkSession (``local[2]``, Spark's Kafka connector
jars), each engine consumes the whole topic in one batch (P=2, max_parallelism 128,
Parquet sinks, the default reader — the native one — or ``--reader``). The job is the
issue's: merchant-risk enrichment (async I/O against a zero-latency in-process service,
so it costs only its machinery) → no refunds → per card, the risky spend in hopping
windows (60 s every 20 s) → an alert when a window's passes 3,000, then a quiet period
with a timer that reports its end → and per merchant, count, takings and risky takings.

- **one dataflow** (:mod:`microbatch.dataflow`): enrich → filter → key_by(card) →
  ``windows.hopping(...).sum("risky").final()`` → key_by(key) → ``SpendAlerts``; the
  filtered payments also → key_by(merchant) → ``MerchantTotals``. One Spark job, one
  exchange (windows and merchants share it, the alerts read the windows on their key in
  the same tasks; stage 1 sends the windows partials, not payments), one commit;
- **one dataflow, hand-made windows**: the same graph with the per-card windows and alerts
  in one step, ``CardWindows``, as the two pipelines have them: what reading once saves,
  apart from what the window step adds or saves;
- **two pipelines** (the reference: what had to be written before dataflows, where a
  window step and a process function could not be chained): the card pipeline
  (``CardWindows``: windows by hand in value state, a timer at each window's end) and the
  merchant pipeline, each reading, decoding and enriching the whole topic, each with its
  own checkpoint and commit; run one after the other.

records/s = records / wall time (for the reference: both pipelines' batches); CPU-s of this
process, the Spark JVM and its Python workers (also shown apart: the JVM reads Kafka and
moves the exchanges, the workers decode and process). Every engine first runs once, untimed, over
the whole topic (``--warmup 0``: over a small topic of its own instead): the first read of
a topic costs about a second more, which would otherwise land on whichever engine goes
first; ``--repeat N`` (default 3: each engine goes first once) rotates
the engines, and the table shows the median and the best of the rounds, with the load at
each start. The alerts, quiet periods and merchants' totals must be the same in all three.

Where the time goes (round 1): the dataflow's batch phases and the stage-2 seconds of
each keyed step's instances (restore, process, state, stage) from the batch's stats, and
every Spark stage of each engine (wall, task time, shuffle) from Spark's REST API: a
second keyed step's cost is its stage against the second pipeline's read and operator.

    .venv/bin/python bench/bench_dataflow.py [--records 300000 | --quick] [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import benchlib
from benchlib import (
    kafka_settings,
    last_stage_id,
    load,
    log,
    print_table,
    process_tree,
    spark_cpu_seconds,
    stage_lines,
    where_time_goes,
)

from microbatch import windows
from microbatch.dataflow import Dataflow
from microbatch.enrich import AsyncOperator, NoRetry
from microbatch.localstack.process import free_port_block
from microbatch.localstack.spark_kafka import ensure_spark_kafka_jars
from microbatch.runtime import (
    BatchOptions,
    BatchResult,
    BatchRunner,
    Enrichment,
    EventTime,
    KafkaSource,
    KeyedProcessFunction,
    ParquetSink,
    Pipeline,
    ProcessContext,
)
from microbatch.settings import Settings
from microbatch.sinks import read_parquet_sink
from microbatch.spark import spark_session

PARTITIONS, PARALLELISM, MAXP = 4, 2, 128
CARDS, MERCHANTS = 2_000, 500
RISKY_FROM = 60  # a merchant's risk score (0-99) from which its takings count as risky
WINDOW_MS, EVERY_MS = 60_000, 20_000  # the hopping window of a card's risky spend
ALERT_AT = 3_000  # risky spend in one window that raises an alert
QUIET_MS = 90_000  # after an alert, the card's windows raise none for this long
assert QUIET_MS % EVERY_MS, "a quiet timer must not fall on a window's end (CardWindows)"
ENGINES = {
    "dataflow": "one dataflow",
    "branches": "one dataflow, hand-made windows",
    "separate": "two pipelines",
}


def payment(n: int) -> bytes:
    amount = -10 if n % 13 == 0 else 5 + (n * 7919) % 400
    body = {"card": f"c{n % CARDS}", "merchant": f"m{(n * 31) % MERCHANTS}", "amount": amount}
    return json.dumps({**body, "ts": 1_700_000_000_000 + n}).encode()


async def merchant_risk(p: dict[str, Any]) -> dict[str, Any]:
    """A zero-latency in-process risk "service": the enrichment costs only its machinery."""
    risk = int(p["merchant"][1:]) * 37 % 100
    return {**p, "risk": risk, "risky": p["amount"] if risk >= RISKY_FROM else 0}


def risk_operator() -> AsyncOperator:
    return AsyncOperator(
        merchant_risk, mode="ordered", capacity=1000, timeout_s=None, retry=NoRetry(),
        on_failure="fail",
    )  # fmt: skip


def alert(card: Any, window_end: int, risky: int, ctx: ProcessContext) -> None:
    """An alert (to ``alerts``) for a closed window whose risky spend passes ALERT_AT, unless
    the card is quiet after an earlier one; a timer reports (to ``quiet``) when it ends."""
    quiet = ctx.value("quiet_until")
    if risky > ALERT_AT and window_end >= quiet.get(0):
        quiet.set(window_end + QUIET_MS)
        ctx.register_timer(window_end + QUIET_MS)
        ctx.emit({"card": card, "window_end": window_end, "risky": risky}, to="alerts")


def quiet_again(card: Any, timestamp_ms: int, ctx: ProcessContext) -> None:
    ctx.emit({"card": card, "quiet_until": timestamp_ms}, to="quiet")


class SpendAlerts(KeyedProcessFunction):
    """Per card, the window step's closed windows (in window order) through :func:`alert`."""

    def process(self, key: Any, records: Sequence[Any], ctx: ProcessContext) -> None:
        for w in records:
            alert(key, w["window_end"], w["sum_risky"], ctx)

    def on_timer(self, key: Any, timestamp_ms: int, ctx: ProcessContext) -> None:
        quiet_again(key, timestamp_ms, ctx)


class CardWindows(KeyedProcessFunction):
    """The same by hand, as one operator had to: a card's open windows ``{start: risky}``
    in value state, a timer at each window's end that closes it through :func:`alert`."""

    def process(self, key: Any, records: Sequence[Any], ctx: ProcessContext) -> None:
        state = ctx.value("windows")
        open_windows = state.get({})
        for p in records:
            if p["amount"] <= 0:
                continue
            ts = p["ts"]
            for start in range(ts - ts % EVERY_MS, ts - WINDOW_MS, -EVERY_MS):
                if start not in open_windows:
                    open_windows[start] = 0
                    ctx.register_timer(start + WINDOW_MS)
                open_windows[start] += p["risky"]
        state.set(open_windows)

    def on_timer(self, key: Any, timestamp_ms: int, ctx: ProcessContext) -> None:
        if timestamp_ms % EVERY_MS:
            quiet_again(key, timestamp_ms, ctx)
            return
        state = ctx.value("windows")
        open_windows = state.get({})
        risky = open_windows.pop(timestamp_ms - WINDOW_MS)
        state.set(open_windows)
        alert(key, timestamp_ms, risky, ctx)


class MerchantTotals(KeyedProcessFunction):
    """Count, takings and risky takings per merchant; one row per merchant and batch."""

    def process(self, key: Any, records: Sequence[Any], ctx: ProcessContext) -> None:
        kept = [p for p in records if p["amount"] > 0]
        totals = ctx.value("totals")
        count, taken, risky = totals.get([0, 0, 0])
        count += len(kept)
        taken += sum(p["amount"] for p in kept)
        risky += sum(p["risky"] for p in kept)
        totals.set([count, taken, risky])
        ctx.emit({"merchant": key, "count": count, "sum": taken, "risky": risky})


def positive(p: dict[str, Any]) -> bool:
    return p["amount"] > 0


def event_time() -> EventTime:
    return EventTime("ts", idle_timeout_s=None)


def card_sinks(root: Path) -> list[ParquetSink]:
    return [ParquetSink("alerts", str(root / "alerts")), ParquetSink("quiet", str(root / "quiet"))]


def one_dataflow(
    name: str, topic: str, root: Path, reader: str = "auto", *, hand_made: bool = False
) -> Pipeline:
    """enrich → no refunds → per card: hopping windows → alerts; → per merchant: totals.
    ``hand_made``: the per-card windows and alerts in one step, :class:`CardWindows`."""
    flow = Dataflow(
        name,
        checkpoints=str(root / "checkpoints"),
        event_time=event_time(),
        max_parallelism=MAXP,
        parallelism=PARALLELISM,
    )
    payments = (
        flow.source(KafkaSource(topics=(topic,), reader=reader))  # type: ignore[arg-type]
        .enrich(Enrichment(risk_operator))
        .filter(positive, name="no-refunds")
    )
    per_card = payments.key_by("card")
    if hand_made:
        per_card.process(CardWindows(), uid="card-alerts", outputs=card_sinks(root))
    else:
        spend = windows.hopping(f"{WINDOW_MS}ms", every=f"{EVERY_MS}ms").sum("risky").final()
        (
            per_card.window(spend, uid="card-spend")
            .key_by("key")
            .process(SpendAlerts(), uid="card-alerts", outputs=card_sinks(root))
        )
    payments.key_by("merchant").process(MerchantTotals(), uid="merchants").to(
        ParquetSink("merchants", str(root / "merchants"))
    )
    return flow.build()


def two_pipelines(name: str, topic: str, root: Path, reader: str = "auto") -> list[Pipeline]:
    """What had to be written before dataflows: each pipeline reads and enriches the topic."""
    common: dict[str, Any] = {
        "source": KafkaSource(topics=(topic,), reader=reader),  # type: ignore[arg-type]
        "enrich": Enrichment(risk_operator),
        "event_time": event_time(),
        "max_parallelism": MAXP,
        "parallelism": PARALLELISM,
    }
    cards = Pipeline(
        name=f"{name}-cards",
        key_by="card",
        process=CardWindows(),
        sinks=card_sinks(root),
        checkpoints=str(root / "cards-checkpoints"),
        **common,
    )
    merchants = Pipeline(
        name=f"{name}-merchants",
        key_by="merchant",
        process=MerchantTotals(),
        sinks=[ParquetSink("merchants", str(root / "merchants"))],
        checkpoints=str(root / "merchants-checkpoints"),
        **common,
    )
    return [cards, merchants]


def run_batches(spark: Any, settings: Settings, pipelines: list[Pipeline]) -> list[BatchResult]:
    return [BatchRunner(spark, p, settings).run(BatchOptions(run_id="bench")) for p in pipelines]


def outputs(root: Path, settings: Settings) -> dict[str, set[tuple]]:
    """Each sink's rows, as a set of tuples in the sink's column order."""
    return {
        sink: {
            tuple(row.values()) for row in read_parquet_sink(str(root / sink), settings).to_pylist()
        }
        for sink in ("alerts", "quiet", "merchants")
    }


Run = tuple[float, float, str]  # seconds, CPU-s, load at start


def cpu_by_process(spark: Any) -> dict[str, float]:
    """CPU seconds so far of the Spark JVM, of the Python workers under it, and of this
    process (the driver)."""
    jvm = spark.sparkContext._gateway.proc.pid
    ticks = process_tree(jvm)
    per_s = os.sysconf("SC_CLK_TCK")
    own = os.times()
    return {
        "JVM": ticks.pop(jvm, 0) / per_s,
        "Python workers": sum(ticks.values()) / per_s,
        "driver": own.user + own.system,
    }


def run(settings: Settings, args: argparse.Namespace, work: Path) -> None:
    bootstrap = settings.kafka_bootstrap_servers
    tag = uuid.uuid4().hex[:8]
    topic, warm_topic = f"bench-dataflow-{tag}", f"bench-dataflow-warmup-{tag}"
    log(f"producing {args.records:,} payments to {topic} ({PARTITIONS} partitions)")
    benchlib.produce(bootstrap, topic, args.records, payment, PARTITIONS)
    if args.warmup:
        benchlib.produce(bootstrap, warm_topic, args.warmup, payment, PARTITIONS)
    else:
        warm_topic = topic
    jars = ensure_spark_kafka_jars(settings.home_path)
    log(f"starting Spark local[2] with {', '.join(j.name for j in jars)}")
    spark = spark_session(settings, "bench-dataflow", conf={
        "spark.sql.shuffle.partitions": str(PARALLELISM),
        "spark.ui.enabled": "true",  # each engine's Spark stages, in "where the time goes"
        "spark.ui.port": str(free_port_block([0])),
        "spark.ui.host": "127.0.0.1",
    })  # fmt: skip
    runs: dict[str, list[Run]] = {name: [] for name in ENGINES}
    split: dict[str, list[dict[str, float]]] = {name: [] for name in ENGINES}
    breakdown: dict[str, list[str]] = {}

    def pipelines(engine: str, name: str, on: str, root: Path) -> list[Pipeline]:
        if engine == "separate":
            return two_pipelines(name, on, root, args.reader)
        return [one_dataflow(name, on, root, args.reader, hand_made=engine == "branches")]

    try:
        size = f"{args.warmup:,}" if args.warmup else f"all {args.records:,}"
        log(f"warm-up (untimed): each engine over {size} payments ...")
        for engine in ENGINES:
            run_batches(spark, settings, pipelines(engine, f"w-{engine}-{tag}", warm_topic,
                                                   work / f"warm-{engine}"))  # fmt: skip

        def measure(i: int, engine: str) -> None:
            # Spark's REST API first: its JVM work (the first call initializes the UI's
            # REST service, ~4 CPU-s) is the bench's, not the batch's.
            first_stage = last_stage_id(spark)
            before, cpu = load(), spark_cpu_seconds(spark)
            by_process = cpu_by_process(spark)
            log(f"[{i + 1}] {ENGINES[engine]}: one batch over the topic ({before}) ...")
            started = time.perf_counter()
            root = work / f"{engine}{i}"
            batch = pipelines(engine, f"b-{engine}-{tag}-{i}", topic, root)
            results = run_batches(spark, settings, batch)
            seconds = time.perf_counter() - started
            cpu = spark_cpu_seconds(spark) - cpu
            runs[engine].append((seconds, cpu, before))
            after = cpu_by_process(spark)
            split[engine].append({k: after[k] - v for k, v in by_process.items()})
            log(f"  {seconds:.2f} s, {cpu:.1f} CPU-s")
            for r in results:
                if r.records_in != args.records:
                    raise SystemExit(f"{r.pipeline} read {r.records_in:,} of {args.records:,}")
            if i == 0:
                steps = where_time_goes(batch[0], settings, results[0]) if len(batch) == 1 else []
                breakdown[engine] = steps + stage_lines(spark, first_stage)

        for i in range(args.repeat):  # rotate the order: load swings hit every engine alike
            order = [*ENGINES][i % len(ENGINES) :] + [*ENGINES][: i % len(ENGINES)]
            for engine in order:
                measure(i, engine)
        sinks = outputs(work / "separate0", settings)
        same = all(outputs(work / f"{engine}0", settings) == sinks for engine in ENGINES)
    finally:
        spark.stop()

    def rate(xs: list[Run], pick: Any) -> float:
        return args.records / pick([s for s, _, _ in xs])

    def cpu(xs: list[Run], pick: Any) -> float:
        return pick([c for _, c, _ in xs])

    def described(xs: list[Run]) -> str:
        return "; ".join(f"{s:.2f} s, {c:.1f} CPU-s ({where})" for s, c, where in xs)

    two = runs["separate"]
    med, best = statistics.median, min
    rows = []
    for engine, what in (
        ("dataflow", "enrich → windows per card → alerts; → per merchant"),
        ("branches", "the same, windows by hand as the two pipelines"),
        ("separate", "each reading and enriching the topic"),
    ):
        xs = runs[engine]
        rate_now = f"{rate(xs, med):,.0f}/s median, {rate(xs, best):,.0f}/s best"
        rows.append((f"{ENGINES[engine]} ({what})", rate_now, described(xs)))
    for engine in ("dataflow", "branches"):
        one = runs[engine]
        rows.append((
            f"{ENGINES[engine]} / two pipelines, records/s",
            f"{rate(one, med) / rate(two, med):.2f} median, "
            f"{rate(one, best) / rate(two, best):.2f} best",
            "target >= 1.5" if engine == "dataflow" else "what reading once saves",
        ))  # fmt: skip
        rows.append((
            f"CPU-s, two pipelines ÷ {ENGINES[engine]}",
            f"{cpu(two, med) / cpu(one, med):.2f} median, "
            f"{cpu(two, best) / cpu(one, best):.2f} best",
            f"{cpu(one, med):.1f} vs {cpu(two, med):.1f} CPU-s (median)",
        ))  # fmt: skip
    counts = ", ".join(f"{len(rows_):,} {sink}" for sink, rows_ in sinks.items())
    rows.append(("outputs", "match" if same else "MISMATCH", f"{counts} rows in each engine"))
    print_table(rows)
    print("\nCPU-s by process, median of the rounds:")
    for engine, name in ENGINES.items():
        parts = {k: med([r[k] for r in split[engine]]) for k in split[engine][0]}
        print(f"  {name}: " + ", ".join(f"{k} {v:.2f}" for k, v in parts.items()))
    print("\nWhere the time goes (round 1): the dataflow's batch and keyed steps, and each")
    print("engine's Spark stages (the two pipelines': read+key, then the operator, twice)")
    for engine, name in ENGINES.items():
        print(f" {name}:")
        print("\n".join(breakdown.get(engine, [])))
    if not same:
        raise SystemExit(1)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=300_000)
    parser.add_argument(
        "--warmup", type=int, default=0, help="payments of a warm-up topic; 0: the topic itself"
    )
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="30,000 records")
    parser.add_argument(
        "--reader",
        choices=("auto", "native", "confluent", "spark", "python"),
        default="auto",
        help="both engines' KafkaSource(reader=...); auto: the native reader",
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.records = 30_000
    with tempfile.TemporaryDirectory(prefix="bench-dataflow-") as tmp:
        work = Path(tmp)
        with kafka_settings(work, work / "home") as settings:
            run(settings, args, work)


if __name__ == "__main__":
    main()
