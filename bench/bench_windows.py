"""Tumbling windows: microbatch vs Structured Streaming vs a hand-written process function.

Produces ``--records`` JSON events ``{"user_id": "user-<n % 10000>", "ts": ..., "amount":
...}`` into a fresh 4-partition topic: event times 1 ms apart (1M events span ~17 minutes),
each up to 5 s out of order. Then, on ONE SparkSession (``local[2]``, Spark's Kafka
connector jars, ``spark.sql.shuffle.partitions`` = the pipeline's parallelism, 2), each
engine consumes the whole topic in one batch and emits the final 1-minute tumbling
windows per user with their count and sum of ``amount``:

- **microbatch windows**: ``process=windows.tumbling("1m").count().sum("amount").final()``,
  ``EventTime("ts", allowed_lateness_s=10, watermark="global_max")``,
  ``KafkaSource(value_schema=JsonSchema(...))`` (the default reader, the native one in
  the stage-1 tasks; ``--reader spark``: the JVM Kafka source, as the reference reads; the
  values decoded with Arrow into columns, pre-aggregated per (key, window) in stage 1 so
  only partials cross the shuffle, as the reference's partial aggregation does before its
  exchange; ``--no-pre-aggregate``: every record shuffled; ``--no-schema``: decoded per
  record, every record shuffled),
  Parquet sink, P=2, max_parallelism 128; one ``BatchRunner.run``;
- **Structured Streaming** (reference 1): the Kafka source, ``from_json``,
  ``withWatermark("t", "10 seconds")``, ``groupBy(window("t", "1 minute"), "user_id")``
  with ``count`` and ``sum`` — Spark's native, JVM-only window aggregation — output mode
  append, ``Trigger.AvailableNow`` (a data batch, then the no-data batch that closes the
  windows), ``foreachBatch`` appending Parquet; timed from ``start()`` to
  ``awaitTermination()``;
- **hand-written** (reference 2): the same pipeline with a ``KeyedProcessFunction`` on the
  per-record path instead of the window operator: each key's open windows in value state,
  Python per record, a timer at each window's end that emits and forgets it (as
  ``examples/clickstream.py`` hand-writes sessions).

records/s = records / wall time of the batch (the session start is shared and excluded);
CPU-s as in ``bench_pipeline.py`` (this process, the JVM, its Python workers). Every engine
first runs once, untimed, over a small warm-up topic; ``--repeat N`` rotates the engines and
reports each one's median and best run (ratios: of medians). The three outputs must be
the same windows, row for row.

Where microbatch's time goes: the batch's own phases (``BatchResult.seconds``), its
instances' stage-2 seconds (restore, process = the window operator, state, stage = the
sink's Parquet), and Spark's stage metrics of the batch's job (Spark's REST API: the map
stage = stage 1, reading and decoding in Python; the reduce stage = stage 2), plus what
decoding the JSON values alone costs per record.

    .venv/bin/python bench/bench_windows.py [--records 1000000 | --quick] [--repeat 1]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import benchlib
import pyarrow.parquet as pq
from benchlib import (
    finish_query,
    kafka_settings,
    last_stage_id,
    load,
    log,
    print_table,
    spark_cpu_seconds,
    spark_stages,
)

from microbatch import windows
from microbatch.checkpoint import Layout, latest_manifest
from microbatch.localstack.process import free_port_block
from microbatch.localstack.spark_kafka import ensure_spark_kafka_jars
from microbatch.runtime import (
    BatchOptions,
    BatchResult,
    BatchRunner,
    EventTime,
    JsonSchema,
    KafkaSource,
    KeyedProcessFunction,
    ParquetSink,
    Pipeline,
    ProcessContext,
    windowed,
)
from microbatch.runtime.decoding import fast_json_decoder
from microbatch.settings import Settings
from microbatch.sinks import read_parquet_sink
from microbatch.spark import spark_session
from microbatch.storage import open_store

REPO = Path(__file__).resolve().parents[1]
PARTITIONS = 4
KEYS = 10_000
PARALLELISM = 2  # microbatch operator instances = Structured Streaming shuffle partitions
TS0 = 1_767_225_600_000  # 2026-01-01T00:00:00Z
SIZE_MS = 60_000
LATENESS_S = 10
EVENT_DDL = "user_id STRING, ts LONG, amount LONG"
COLUMNS = ("key", "window_start", "window_end", "count", "sum_amount")


def event(n: int) -> bytes:
    ts = TS0 + n - (n * 7919) % 5000  # up to 5 s out of order
    return f'{{"user_id": "user-{n % KEYS}", "ts": {ts}, "amount": {n % 100}}}'.encode()


# The microbatch pipelines (module level: pickled to the Spark workers) -----------------


class TumblingByHand(KeyedProcessFunction):
    """1-minute windows per key, per record: ``{start: [count, sum]}`` in value state, a
    timer at each window's end emits the window and forgets it."""

    def process(self, key: Any, records: Sequence[Any], ctx: ProcessContext) -> None:
        state = ctx.value("windows")
        open_ = state.get(None) or {}
        for r in records:
            ts = r["ts"]
            start = str(ts - ts % SIZE_MS)
            window = open_.get(start)
            if window is None:
                open_[start] = [1, r["amount"]]
                ctx.register_timer(int(start) + SIZE_MS)
            else:
                window[0] += 1
                window[1] += r["amount"]
        state.set(open_)

    def on_timer(self, key: Any, timestamp_ms: int, ctx: ProcessContext) -> None:
        state = ctx.value("windows")
        open_ = state.get(None) or {}
        count, total = open_.pop(str(timestamp_ms - SIZE_MS))
        ctx.emit(
            {
                "key": key,
                "window_start": timestamp_ms - SIZE_MS,
                "window_end": timestamp_ms,
                "count": count,
                "sum_amount": total,
            }
        )
        state.set(open_) if open_ else state.clear()


#: The events' fields, declared for microbatch's windows (the reference's EVENT_DDL).
SCHEMA = JsonSchema({"user_id": "string", "ts": "long", "amount": "long"})


def make_pipeline(
    name: str, topic: str, root: Path, by_hand: bool, schema: bool = True, reader: str = "auto"
) -> Pipeline:
    process = TumblingByHand() if by_hand else windows.tumbling("1m").count().sum("amount").final()
    declared = SCHEMA if schema and not by_hand else None  # by hand: the per-record path
    return Pipeline(
        name=name,
        source=KafkaSource(
            topics=(topic,),
            starting="earliest",
            reader=reader,  # type: ignore[arg-type]
            value_schema=declared,
        ),
        key_by="user_id",
        event_time=EventTime(
            "ts", allowed_lateness_s=LATENESS_S, idle_timeout_s=None, watermark="global_max"
        ),
        process=process,
        sinks=[ParquetSink("windows", str(root / "windows"))],
        checkpoints=str(root / "checkpoints"),
        max_parallelism=128,
        parallelism=PARALLELISM,
    )


# The Structured Streaming reference -----------------------------------------------------


def run_structured_streaming(spark: Any, bootstrap: str, topic: str, root: Path) -> float:
    from pyspark.sql import functions as F

    out = str(root / "windows")
    events = (
        spark.readStream.format("kafka")
        .option("kafka.bootstrap.servers", bootstrap)
        .option("subscribe", topic)
        .option("startingOffsets", "earliest")
        .option("failOnDataLoss", "true")
        .load()
        .select(F.from_json(F.col("value").cast("string"), EVENT_DDL).alias("e"))
        .select("e.*", F.timestamp_millis(F.col("e.ts")).alias("t"))
        .withWatermark("t", f"{LATENESS_S} seconds")
    )  # fmt: skip
    windowed = (
        events.groupBy(F.window("t", "1 minute").alias("w"), "user_id")
        .agg(F.count("*").alias("count"), F.sum("amount").alias("sum_amount"))
        .select(
            F.col("user_id").alias("key"),
            F.unix_millis("w.start").alias("window_start"),
            F.unix_millis("w.end").alias("window_end"),
            "count",
            "sum_amount",
        )
    )

    def write(batch: Any, batch_id: int) -> None:
        batch.write.mode("append").parquet(out)

    started = time.perf_counter()
    query = (
        windowed.writeStream.outputMode("append")
        .foreachBatch(write)
        .trigger(availableNow=True)
        .option("checkpointLocation", str(root / "checkpoint"))
        .start()
    )
    return finish_query(query, started)


# Measurements ----------------------------------------------------------------------------


def run_microbatch(spark: Any, settings: Settings, pipeline: Pipeline) -> tuple[float, BatchResult]:
    started = time.perf_counter()
    runner = BatchRunner(spark, pipeline, settings)
    result = runner.run(BatchOptions(run_id="bench"))
    wanted = pipeline.source.reader
    if result.records_in and wanted != "auto" and runner.stage_one_reader != wanted:
        raise SystemExit(f"stage 1 read with {runner.stage_one_reader!r}, not {wanted!r}")
    log(f"  stage 1 read with {runner.stage_one_reader}")
    return time.perf_counter() - started, result


def window_rows(table: Any) -> set[tuple]:
    cols = table.select(list(COLUMNS)).to_pydict()
    return set(zip(*(cols[c] for c in COLUMNS), strict=True))


def decode_cost(records: int) -> float:
    """µs per record of decoding the JSON values alone (stage 1's decoder, in this
    process), over a sample of the bench's events."""
    sample = [event(i) for i in range(min(records, 200_000))]
    started = time.perf_counter()
    for value in sample:
        fast_json_decoder(value)
    return (time.perf_counter() - started) / len(sample) * 1e6


#: (wall seconds, CPU seconds, load average at the start) of one measured run.
Run = tuple[float, float, str]
ENGINES = {
    "windows": "microbatch windows",
    "ss": "Structured Streaming",
    "hand": "hand-written KeyedProcessFunction",
}


def run(settings: Settings, args: argparse.Namespace, work: Path) -> None:
    bootstrap = settings.kafka_bootstrap_servers
    tag = uuid.uuid4().hex[:8]
    topic, warm_topic = f"bench-windows-{tag}", f"bench-windows-warmup-{tag}"
    log(f"producing {args.records:,} events to {topic} ({PARTITIONS} partitions) on {bootstrap}")
    benchlib.produce(bootstrap, topic, args.records, event, PARTITIONS)
    if args.warmup:
        benchlib.produce(bootstrap, warm_topic, args.warmup, event, PARTITIONS)

    jars = ensure_spark_kafka_jars(settings.home_path)
    log(f"starting Spark local[2] with {', '.join(j.name for j in jars)}")
    ui_port = free_port_block([0])
    conf = {
        "spark.sql.shuffle.partitions": str(PARALLELISM),
        "spark.ui.enabled": "true",  # for the stage metrics, the same for every engine
        "spark.ui.port": str(ui_port),
        "spark.ui.host": "127.0.0.1",
    }
    spark = spark_session(settings, "bench-windows", conf=conf)
    runs: dict[str, list[Run]] = {name: [] for name in ENGINES}
    breakdown: list[str] = []
    try:
        if args.warmup:
            log(f"warm-up (untimed): each engine over {args.warmup:,} records ...")
            for by_hand in (False, True):
                warm = make_pipeline(
                    f"warm-{by_hand}-{tag}",
                    warm_topic,
                    work / f"w{by_hand}",
                    by_hand,
                    args.schema,
                    args.reader,
                )
                run_microbatch(spark, settings, warm)
            run_structured_streaming(spark, bootstrap, warm_topic, work / "w-ss")

        def microbatch_run(i: int, name: str) -> None:
            stage_id = last_stage_id(spark)  # before the CPU count: the REST call is the bench's
            before, cpu = load(), spark_cpu_seconds(spark)
            log(f"[{i + 1}] {ENGINES[name]}: one batch over the topic ({before}) ...")
            pipeline = make_pipeline(
                f"bench-{name}-{tag}-{i}",
                topic,
                work / f"{name}{i}",
                name == "hand",
                args.schema,
                args.reader,
            )
            seconds, result = run_microbatch(spark, settings, pipeline)
            cpu = spark_cpu_seconds(spark) - cpu
            runs[name].append((seconds, cpu, before))
            log(f"  {seconds:.2f} s, {cpu:.1f} CPU-s; phases {result.seconds}")
            if result.records_in != args.records:
                raise SystemExit(f"microbatch read {result.records_in:,} of {args.records:,}")
            if i == 0:
                breakdown.extend(where_time_goes(spark, settings, pipeline, result, stage_id, name))

        def streaming_run(i: int) -> None:
            before, cpu = load(), spark_cpu_seconds(spark)
            log(f"[{i + 1}] Structured Streaming: AvailableNow over the whole topic ({before}) ...")
            seconds = run_structured_streaming(spark, bootstrap, topic, work / f"ss{i}")
            cpu = spark_cpu_seconds(spark) - cpu
            runs["ss"].append((seconds, cpu, before))
            log(f"  {seconds:.2f} s, {cpu:.1f} CPU-s")

        measures: list[Any] = [
            lambda i: microbatch_run(i, "windows"),
            streaming_run,
            lambda i: microbatch_run(i, "hand"),
        ]
        for i in range(args.repeat):  # rotate the order: load swings hit every engine alike
            for k in range(len(measures)):
                measures[(i + k) % len(measures)](i)

        outputs = {
            "windows": window_rows(read_parquet_sink(str(work / "windows0" / "windows"), settings)),
            "ss": window_rows(pq.read_table(str(work / "ss0" / "windows"))),
            "hand": window_rows(read_parquet_sink(str(work / "hand0" / "windows"), settings)),
        }
    finally:
        spark.stop()

    best = {name: min(xs) for name, xs in runs.items()}
    rate = {name: args.records / b[0] for name, b in best.items()}
    # The ratios are of medians (seconds and CPU-s each their own median).
    median = {
        name: (statistics.median(r[0] for r in xs), statistics.median(r[1] for r in xs))
        for name, xs in runs.items()
    }
    counted = sum(r[3] for r in outputs["ss"])
    same = outputs["windows"] == outputs["ss"] == outputs["hand"]
    detail = f"{len(outputs['ss']):,} windows holding {counted:,} records, in all three"
    if not same:
        sizes = ", ".join(f"{ENGINES[k]} {len(v):,}" for k, v in outputs.items())
        detail = f"the outputs differ: windows {sizes}"

    def described(xs: list[Run]) -> str:
        listed = "; ".join(f"{s:.2f} s, {cpu:.1f} CPU-s ({where} at start)" for s, cpu, where in xs)
        if len(xs) == 1:
            return listed
        mid = statistics.median(s for s, _, _ in xs)
        return f"median {args.records / mid:,.0f}/s; best of " + listed

    def versus(ref: str) -> tuple[str, str]:
        """(ratio of median wall times, notes: the CPU-s ratio of medians and the bests')."""
        wall = median[ref][0] / median["windows"][0]
        notes = (
            f"median; best {rate['windows'] / rate[ref]:.3f}. CPU-s ratio (reference ÷ ours) "
            f"{median[ref][1] / median['windows'][1]:.3f} median, "
            f"{best[ref][1] / best['windows'][1]:.3f} of the bests"
        )
        return f"{wall:.3f}", notes

    rows = [
        (
            f"microbatch windows (tumbling 1m count+sum, P={PARALLELISM})",
            f"{rate['windows']:,.0f}/s",
            described(runs["windows"]),
        ),
        (
            "Structured Streaming (window() + groupBy, JVM)",
            f"{rate['ss']:,.0f}/s",
            f"{PARALLELISM} shuffle partitions; foreachBatch → Parquet; " + described(runs["ss"]),
        ),
        (
            "hand-written KeyedProcessFunction (per record)",
            f"{rate['hand']:,.0f}/s",
            "value state + timers; " + described(runs["hand"]),
        ),
        ("microbatch windows / Structured Streaming", *versus("ss")),
        ("microbatch windows / hand-written", *versus("hand")),
        ("final windows", "match" if same else "MISMATCH", detail),
    ]
    print_table(rows)
    print("\nWhere a batch's time goes (first run of each microbatch pipeline):")
    print("\n".join(breakdown))
    print(f"  decoding the JSON values alone: {decode_cost(args.records):.2f} µs per record")
    if not same:
        raise SystemExit(1)


def where_time_goes(
    spark: Any,
    settings: Settings,
    pipeline: Pipeline,
    result: BatchResult,
    stage_id: int,
    name: str,
) -> list[str]:
    """Lines for the breakdown: driver phases, Spark stages, stage-2 instances."""
    lines = [f"  {ENGINES[name]}:"]
    phases = ", ".join(f"{k} {v:.2f}" for k, v in result.seconds.items() if v >= 0.005)
    lines.append(f"    batch phases (s): {phases}")
    for s in spark_stages(spark, stage_id):
        wall = _ms(s.get("completionTime")) - _ms(s.get("submissionTime"))
        lines.append(
            f"    Spark stage {s['stageId']} ({s['numTasks']} tasks, {s['name'][:40]}): "
            f"{wall / 1000:.2f} s wall, {s['executorRunTime'] / 1000:.2f} s task time, "
            f"{s['executorCpuTime'] / 1e9:.2f} s JVM CPU, "
            f"shuffle write {s.get('shuffleWriteBytes', 0) / 1e6:.1f} MB"
            + per_record(s.get("shuffleWriteBytes", 0), result.records_in)
        )
    manifest = latest_manifest(open_store(pipeline.checkpoints, settings), Layout())
    for inst in manifest.metadata["stats"]["instances"] if manifest else []:
        seconds = ", ".join(f"{k} {v:.2f}" for k, v in inst["seconds"].items())
        lines.append(
            f"    stage 2, instance {inst['instance']}: {inst.get('records', 0):,} records, "
            f"{inst.get('partials', 0):,} partials, "
            f"{inst.get('windows_emitted', inst.get('timers_fired', 0)):,} windows; s: {seconds}"
        )
    return lines


def per_record(shuffled: int, records: int) -> str:
    return f" ({shuffled / records:.1f} B/record)" if shuffled and records else ""


def _ms(stamp: str | None) -> float:
    """Epoch ms of the REST API's ``2026-11-25T12:00:00.123GMT``."""
    import datetime as dt

    if not stamp:
        return 0.0
    parsed = dt.datetime.strptime(stamp.replace("GMT", "+0000"), "%Y-%m-%dT%H:%M:%S.%f%z")
    return parsed.timestamp() * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--records", type=int, default=1_000_000)
    parser.add_argument("--quick", action="store_true", help="100,000 records")
    parser.add_argument("--warmup", type=int, default=20_000, help="records; 0: no warm-up")
    parser.add_argument(
        "--repeat", type=int, default=1, help="runs of each engine (median and best reported)"
    )
    parser.add_argument(
        "--no-schema",
        dest="schema",
        action="store_false",
        help="microbatch windows without a declared schema (values decoded per record)",
    )
    parser.add_argument(
        "--no-pre-aggregate",
        dest="pre_aggregate",
        action="store_false",
        help="microbatch windows without stage 1's partial aggregation (every record shuffled)",
    )
    parser.add_argument(
        "--reader",
        choices=("auto", "native", "confluent", "spark", "python"),
        default="auto",
        help="microbatch's KafkaSource(reader=...); auto: the native reader",
    )
    args = parser.parse_args()
    windowed.PRE_AGGREGATE = args.pre_aggregate
    if args.quick:
        args.records = 100_000
    work = Path(tempfile.mkdtemp(prefix="bench-windows-"))
    try:
        with kafka_settings(work, REPO / ".local") as settings:
            run(settings, args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
