"""The payments job as one dataflow vs as two pipelines reading the topic twice.

Produces ``--records`` JSON payments ``{"card": "c<n % 2000>", "merchant": "m<n % 500>",
"amount": ..., "ts": ...}`` into a fresh 4-partition topic (every 13th a refund, amount
< 0). Then, on ONE SparkSession (``local[2]``, Spark's Kafka connector jars), each engine
consumes the whole topic in one batch (P=2, max_parallelism 128, Parquet sinks, the
default reader — confluent-kafka — or ``--reader``):

- **one dataflow** (:mod:`microbatch.dataflow`): filter refunds → key_by(card) →
  ``CardSpend`` (running total in value state, an alert side output the first time a card
  passes 2,500, a timer per payment) → key_by(merchant) → ``MerchantTotals`` (count and
  sum in value state, one row per merchant and batch). One Spark job, two exchanges, one
  commit;
- **two pipelines** (the reference: what had to be written before dataflows): the card
  pipeline (``CardSpend`` with the filter inside) and the merchant pipeline
  (``MerchantTotals`` with the filter inside), each reading and decoding the whole topic,
  each with its own checkpoint and commit; run one after the other.

records/s = records / wall time (for the reference: both pipelines' batches); CPU-s of this
process, the Spark JVM and its Python workers (also shown apart: the JVM reads Kafka and
moves the exchanges, the workers decode and process). Every engine first runs once, untimed, over
the whole topic (``--warmup 0``: over a small topic of its own instead): the first read of
a topic costs about a second more, which would otherwise land on whichever engine goes
first; ``--repeat N`` (default 4: each engine goes first as often) rotates
the engines, and the table shows the median and the best of the rounds, with the load at
each start. The alerts and the merchants' totals must be the same in both.

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

from microbatch.dataflow import Dataflow
from microbatch.localstack.process import free_port_block
from microbatch.localstack.spark_kafka import ensure_spark_kafka_jars
from microbatch.runtime import (
    BatchOptions,
    BatchResult,
    BatchRunner,
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
CARDS, MERCHANTS, ALERT_AT = 2_000, 500, 2_500
ENGINES = {"dataflow": "one dataflow", "separate": "two pipelines"}


def payment(n: int) -> bytes:
    amount = -10 if n % 13 == 0 else 5 + (n * 7919) % 400
    body = {"card": f"c{n % CARDS}", "merchant": f"m{(n * 31) % MERCHANTS}", "amount": amount}
    return json.dumps({**body, "ts": 1_700_000_000_000 + n}).encode()


class CardSpend(KeyedProcessFunction):
    """Running spend per card; an alert (to ``alerts``) the first time it passes 2,500."""

    def __init__(self, keep_refunds: bool = True, hand_on: bool = True) -> None:
        self.keep_refunds = keep_refunds
        self.hand_on = hand_on  # emit each payment on, for the next keyed step

    def process(self, key: Any, records: Sequence[Any], ctx: ProcessContext) -> None:
        total, alerted = ctx.value("total"), ctx.value("alerted")
        spent = total.get(0)
        for p in records:
            if not self.keep_refunds and p["amount"] <= 0:
                continue
            spent += p["amount"]
            if self.hand_on:
                ctx.emit(p)
            if spent > ALERT_AT and not alerted.get(False):
                alerted.set(True)
                ctx.emit({"card": key, "total": spent, "at": p["ts"]}, to="alerts")
        total.set(spent)
        if records:
            ctx.register_timer(records[-1]["ts"] + 3_600_000)


class MerchantTotals(KeyedProcessFunction):
    def __init__(self, keep_refunds: bool = True) -> None:
        self.keep_refunds = keep_refunds

    def process(self, key: Any, records: Sequence[Any], ctx: ProcessContext) -> None:
        kept = [p for p in records if self.keep_refunds or p["amount"] > 0]
        count, total = ctx.value("count"), ctx.value("sum")
        count.set(count.get(0) + len(kept))
        total.set(total.get(0) + sum(p["amount"] for p in kept))
        ctx.emit({"merchant": key, "count": count.get(), "sum": total.get()})


def positive(p: dict[str, Any]) -> bool:
    return p["amount"] > 0


def event_time() -> EventTime:
    return EventTime("ts", idle_timeout_s=None)


def one_dataflow(name: str, topic: str, root: Path, reader: str = "auto") -> Pipeline:
    flow = Dataflow(
        name,
        checkpoints=str(root / "checkpoints"),
        event_time=event_time(),
        max_parallelism=MAXP,
        parallelism=PARALLELISM,
    )
    cards = (
        flow.source(KafkaSource(topics=(topic,), reader=reader))  # type: ignore[arg-type]
        .filter(positive, name="no-refunds")
        .key_by("card")
        .process(CardSpend(), uid="cards", outputs=[ParquetSink("alerts", str(root / "alerts"))])
    )
    cards.key_by("merchant").process(MerchantTotals(), uid="merchants").to(
        ParquetSink("merchants", str(root / "merchants"))
    )
    return flow.build()


def two_pipelines(name: str, topic: str, root: Path, reader: str = "auto") -> list[Pipeline]:
    common: dict[str, Any] = {
        "source": KafkaSource(topics=(topic,), reader=reader),  # type: ignore[arg-type]
        "event_time": event_time(),
        "max_parallelism": MAXP,
        "parallelism": PARALLELISM,
    }
    cards = Pipeline(
        name=f"{name}-cards",
        key_by="card",
        process=CardSpend(keep_refunds=False, hand_on=False),
        sinks=[ParquetSink("alerts", str(root / "alerts"))],
        checkpoints=str(root / "cards-checkpoints"),
        **common,
    )
    merchants = Pipeline(
        name=f"{name}-merchants",
        key_by="merchant",
        process=MerchantTotals(keep_refunds=False),
        sinks=[ParquetSink("merchants", str(root / "merchants"))],
        checkpoints=str(root / "merchants-checkpoints"),
        **common,
    )
    return [cards, merchants]


def run_batches(spark: Any, settings: Settings, pipelines: list[Pipeline]) -> list[BatchResult]:
    return [BatchRunner(spark, p, settings).run(BatchOptions(run_id="bench")) for p in pipelines]


def outputs(root: Path, settings: Settings) -> tuple[set[tuple], set[tuple]]:
    alerts = read_parquet_sink(str(root / "alerts"), settings).to_pylist()
    merchants = read_parquet_sink(str(root / "merchants"), settings).to_pylist()
    return (
        {(a["card"], a["total"], a["at"]) for a in alerts},
        {(m["merchant"], m["count"], m["sum"]) for m in merchants},
    )


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
        if engine == "dataflow":
            return [one_dataflow(name, on, root, args.reader)]
        return two_pipelines(name, on, root, args.reader)

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

        for i in range(args.repeat):  # rotate the order: load swings hit both alike
            order = list(ENGINES) if i % 2 == 0 else list(reversed(ENGINES))
            for engine in order:
                measure(i, engine)
        same = outputs(work / "dataflow0", settings) == outputs(work / "separate0", settings)
        alerts, merchants = outputs(work / "dataflow0", settings)
    finally:
        spark.stop()

    def rate(xs: list[Run], pick: Any) -> float:
        return args.records / pick([s for s, _, _ in xs])

    def cpu(xs: list[Run], pick: Any) -> float:
        return pick([c for _, c, _ in xs])

    def described(xs: list[Run]) -> str:
        return "; ".join(f"{s:.2f} s, {c:.1f} CPU-s ({where})" for s, c, where in xs)

    one, two = runs["dataflow"], runs["separate"]
    med, best = statistics.median, min
    rows = [
        (
            "one dataflow (filter → cards → merchants)",
            f"{rate(one, med):,.0f}/s median, {rate(one, best):,.0f}/s best",
            described(one),
        ),
        (
            "two pipelines reading the topic twice",
            f"{rate(two, med):,.0f}/s median, {rate(two, best):,.0f}/s best",
            described(two),
        ),
        (
            "one dataflow / two pipelines, records/s",
            f"{rate(one, med) / rate(two, med):.2f} median, "
            f"{rate(one, best) / rate(two, best):.2f} best",
            "target >= 1.5",
        ),
        (
            "CPU-s, two pipelines ÷ one dataflow",
            f"{cpu(two, med) / cpu(one, med):.2f} median, "
            f"{cpu(two, best) / cpu(one, best):.2f} best",
            f"{cpu(one, med):.1f} vs {cpu(two, med):.1f} CPU-s (median)",
        ),
        (
            "outputs",
            "match" if same else "MISMATCH",
            f"{len(alerts):,} alerts, {len(merchants):,} merchant rows in both",
        ),
    ]
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
    parser.add_argument("--repeat", type=int, default=4)
    parser.add_argument("--quick", action="store_true", help="30,000 records")
    parser.add_argument(
        "--reader",
        choices=("auto", "confluent", "spark", "python"),
        default="auto",
        help="both engines' KafkaSource(reader=...); auto: confluent-kafka",
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
