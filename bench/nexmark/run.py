"""Nexmark q0–q8 on microbatch and on Spark Structured Streaming, in one run, same events.

Events come from the real Nexmark generator (the Rust crate ``nexmark``, built once into
``.local/nexmark`` by ``cargo install``); ``--events N`` of them are generated once into
``.local/nexmark/events-<N>/`` and reused, then written into three fresh topics (person,
auction, bid; ``--partitions`` each) of a Kafka broker started for the run, with Spark's
Kafka writer. On ONE SparkSession (``local[2]``, the Kafka connector jars, 2 shuffle
partitions) each query then consumes its topics whole, once per engine and round:

- **microbatch**: the query's dataflow (:mod:`nexmark.queries`), one batch (``BatchRunner``,
  P=2, Parquet sink), reading with the default reader (the native reader in the stage-1
  tasks; ``--reader confluent``: confluent-kafka; ``--reader spark``: Spark's JVM Kafka
  source, as the reference reads), decoding per record (``--schema``: with the events'
  declared schemas, into Arrow columns);
- **Structured Streaming** (:mod:`nexmark.spark_queries`): the Kafka source, ``from_json``,
  the query, Parquet in append mode, ``Trigger.AvailableNow``; q4 it cannot express.

``--batch-records N`` splits both engines' runs into batches (microbatch's
``max_records_per_batch``, Spark's ``maxOffsetsPerTrigger`` per topic); above 2M events
it defaults to 2M, so that a batch's records fit in the Python workers' memory. Results
must then still be equal (windows and joins span batches).

records/s = records of the query's topics / wall seconds; CPU-s of this process, the Spark
JVM and its Python workers (not the broker). Every engine first runs each query once,
untimed (``--warmup 0``: over the topics themselves; ``--warmup N``: over N events of
their own). Then ``--rounds`` rounds (default 3) rotate the engines; the table shows the
median and the best, the ratio of the medians, events/s per core (records ÷ CPU-s,
median) beside Flink's published figure, and whether the results are equal: microbatch's
to Spark's, and both to a plain-Python reference (:mod:`nexmark.reference`; for q4 the
only check; not for q0–q2, whose result is their input).

    .venv/bin/python bench/nexmark/run.py [--events 200k] [--queries q0,q5] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: benchlib, nexmark

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from benchlib import (
    kafka_settings,
    last_stage_id,
    load,
    log,
    spark_cpu_seconds,
    stage_lines,
    where_time_goes,
)

from microbatch.localstack.process import free_port_block
from microbatch.localstack.spark_kafka import ensure_spark_kafka_jars
from microbatch.runtime import BatchOptions, BatchRunner
from microbatch.settings import Settings
from microbatch.sinks import read_parquet_sink
from microbatch.spark import spark_session
from nexmark import events as nx_events
from nexmark import queries, reference, spark_queries

REPO = Path(__file__).resolve().parents[2]
HOME = REPO / ".local" / "nexmark"
ENGINES = ("microbatch", "spark")
#: Flink's events/s per core, nexmark/nexmark's published results (as quoted in issue 29).
FLINK_PER_CORE = {"q0": 155_000, "q1": 158_000, "q2": 175_000, "q3": 152_000,
                  "q4": 34_000, "q5": 22_000, "q7": 12_000, "q8": 146_000}  # fmt: skip

Run = tuple[float, float, str]  # wall seconds, CPU seconds, load at the start
#: Above this many events both engines read in batches of BATCH_RECORDS (unless given).
ONE_BATCH_UP_TO, BATCH_RECORDS = 2_000_000, 2_000_000
#: Spark's heap above ONE_BATCH_UP_TO events: a 2M-record batch of q7's stream-stream join
#: ran Structured Streaming out of a 1g heap at 10M events.
BIG_HEAP = "6g"


def count_text(n: int) -> str:
    return f"{n // 1_000_000}M" if n % 1_000_000 == 0 else f"{n:,}"


def count(text: str) -> int:
    """``200k``, ``10M``, ``1_000_000`` → an int."""
    text = text.strip().replace("_", "").lower()
    scale = {"k": 1_000, "m": 1_000_000}.get(text[-1:], 1)
    return int(float(text[:-1] if scale > 1 else text) * scale)


class Bench:
    """One run: the topics, the session, the measurements."""

    def __init__(self, settings: Settings, spark: Any, work: Path, args: argparse.Namespace):
        self.settings, self.spark, self.work, self.args = settings, spark, work, args
        self.bootstrap = settings.kafka_bootstrap_servers
        self.tag = uuid.uuid4().hex[:8]
        self.runs: dict[tuple[str, str], list[Run]] = {}
        self.breakdown: dict[str, list[str]] = {}
        self.last: tuple[Any, Any] = (None, None)  # microbatch's last pipeline and result

    def topics(self, events: nx_events.Events, label: str) -> dict[str, str]:
        topics = {k: f"nexmark-{label}-{self.tag}-{k}" for k in nx_events.KINDS}
        log(f"producing {events.events:,} events into {', '.join(topics.values())} ...")
        nx_events.produce(self.spark, self.bootstrap, events, topics, self.args.partitions, log)
        return topics

    def microbatch(self, query: str, topics: dict[str, str], root: Path, expect: int) -> float:
        build, _ = queries.QUERIES[query]
        reading = queries.Reading(self.args.schema, self.args.batch_records, self.args.reader)
        pipeline = build(f"nexmark-{query}-{root.name}", queries.Topics(**topics), root, reading)
        runner = BatchRunner(self.spark, pipeline, self.settings)
        started, read = time.perf_counter(), 0
        while read < expect:  # one batch, or several of --batch-records
            result = runner.run(BatchOptions(run_id="bench"))
            if result.dead_letters:
                raise SystemExit(f"microbatch {query}: dead letters {result.dead_letter_reasons}")
            if not result.records_in:
                raise SystemExit(f"microbatch {query} read {read:,} of {expect:,}")
            read += result.records_in
        elapsed = time.perf_counter() - started
        self.last = (pipeline, result)
        return elapsed

    def structured_streaming(self, query: str, topics: dict[str, str], root: Path) -> float:
        read = spark_queries.make_reader(
            self.spark, self.bootstrap, topics, nx_events.SPARK_DDL, self.args.batch_records
        )
        result = spark_queries.QUERIES[query](read)
        return spark_queries.run(result, str(root / "out"), str(root / "checkpoint"))

    def once(self, engine: str, query: str, topics: dict[str, str], root: Path,
             expect: int) -> float:  # fmt: skip
        if engine == "microbatch":
            return self.microbatch(query, topics, root, expect)
        return self.structured_streaming(query, topics, root)

    def measure(self, i: int, engine: str, query: str, topics: dict[str, str], expect: int) -> None:
        root = self.work / f"{query}-{engine}-{i}"
        # Spark's REST API outside the CPU count: its JVM work is the bench's, not the run's.
        first_stage = last_stage_id(self.spark)
        before, cpu = load(), spark_cpu_seconds(self.spark)
        log(f"[{i + 1}] {query} {engine} ({before}) ...")
        seconds = self.once(engine, query, topics, root, expect)
        cpu = spark_cpu_seconds(self.spark) - cpu
        if engine == "microbatch" and query not in self.breakdown:
            pipeline, result = self.last
            lines = where_time_goes(pipeline, self.settings, result)
            self.breakdown[query] = lines + stage_lines(self.spark, first_stage)
        self.runs.setdefault((query, engine), []).append((seconds, cpu, before))
        log(f"  {seconds:.2f} s, {cpu:.1f} CPU-s, {expect / seconds:,.0f} records/s")
        if i > 0:
            shutil.rmtree(root, ignore_errors=True)  # round 1's outputs are compared


def engines_of(query: str) -> tuple[str, ...]:
    return ENGINES if query in spark_queries.QUERIES else ("microbatch",)


def expected(events: nx_events.Events, query: str) -> int:
    return sum(events.counts[k] for k in queries.QUERIES[query][1])


# Results -----------------------------------------------------------------------------------


def canonical(table: pa.Table, columns: tuple[str, ...]) -> pa.Table:
    """``columns`` of ``table``, ints as int64, floats as float64, text as string, sorted
    by every column: two results are equal when these are. No rows: one empty table
    (a sink that wrote nothing has no columns to read)."""
    if table.num_rows == 0:
        return pa.table({name: pa.array([], pa.string()) for name in columns})
    out = []
    for name in columns:
        col = table.column(name)
        if pa.types.is_integer(col.type):
            col = col.cast(pa.int64())
        elif pa.types.is_floating(col.type):
            col = col.cast(pa.float64())
        elif pa.types.is_large_string(col.type) or pa.types.is_string(col.type):
            col = col.cast(pa.string())
        out.append(col)
    t = pa.Table.from_arrays(out, names=list(columns)).combine_chunks()
    return t.take(pc.sort_indices(t, sort_keys=[(c, "ascending") for c in columns]))


def as_table(rows: list[tuple], columns: tuple[str, ...]) -> pa.Table:
    return pa.Table.from_pylist([dict(zip(columns, r, strict=True)) for r in rows])


def reference_result(query: str, events: nx_events.Events) -> pa.Table:
    fn, kinds, timed = reference.REFERENCES[query]
    inputs: list[Any] = [reference.read_events(events.path(k)) for k in kinds]
    if timed:  # the watermark both engines end with (the largest event time of the topics)
        inputs.append(max(events.last_ms[k] for k in kinds) - queries.LATENESS_S * 1000)
    columns = reference.COLUMNS[query]
    return canonical(as_table(fn(*inputs), columns), columns)


def compare(bench: Bench, query: str, events: nx_events.Events) -> tuple[str, int]:
    """'✓' / '✗ ...' for round 1's results of the query, and microbatch's row count."""
    columns = reference.COLUMNS[query]
    root = bench.work
    output = read_parquet_sink(str(root / f"{query}-microbatch-0" / "out"), bench.settings)
    if query == "q4":  # a row per category and batch: the average so far; the last counts
        latest = {r["category"]: r for r in sorted(output.to_pylist(), key=lambda r: r["auctions"])}
        output = pa.Table.from_pylist(list(latest.values()))
    mine = canonical(output, columns)
    verdicts = []
    if query in spark_queries.QUERIES:
        theirs = canonical(pq.read_table(root / f"{query}-spark-0" / "out"), columns)
        verdicts.append(("Spark", mine.equals(theirs), theirs.num_rows))
    if query not in ("q0", "q1", "q2"):
        ref = reference_result(query, events)
        verdicts.append(("reference", mine.equals(ref), ref.num_rows))
    for engine in ENGINES:
        shutil.rmtree(root / f"{query}-{engine}-0", ignore_errors=True)
    ok = all(same for _, same, _ in verdicts)
    text = "✓ " if ok else "✗ "
    text += ", ".join(
        f"{'=' if same else '≠'} {who}" + ("" if same else f" ({n:,} rows vs {mine.num_rows:,})")
        for who, same, n in verdicts
    )
    return text, mine.num_rows


# The run -----------------------------------------------------------------------------------


def ship_bench_code() -> None:
    """Pickle this package by value: Spark's Python workers cannot import ``bench/``. The
    runner ships a pipeline's own modules itself, but only those of its process functions
    and stateless steps — not a function inside a library operator (q8's ``select`` of a
    ``WindowJoin``) nor the steps on a graph's edges."""
    from pyspark import cloudpickle

    import nexmark

    cloudpickle.register_pickle_by_value(nexmark)


def run(settings: Settings, args: argparse.Namespace, work: Path) -> None:
    ship_bench_code()
    events = nx_events.ensure_events(HOME, args.events, log)
    warm = nx_events.ensure_events(HOME, args.warmup, log) if args.warmup else events
    ensure_spark_kafka_jars(settings.home_path)
    log("starting Spark local[2] with the Kafka connector")
    spark = spark_session(settings, "bench-nexmark", conf={
        "spark.sql.shuffle.partitions": str(queries.PARALLELISM),
        "spark.sql.streaming.multipleWatermarkPolicy": "max",
        "spark.driver.memory": args.driver_memory,
        "spark.ui.enabled": "true",  # the stage metrics of "where the time goes"
        "spark.ui.port": str(free_port_block([0])),
        "spark.ui.host": "127.0.0.1",
    })  # fmt: skip
    bench = Bench(settings, spark, work, args)
    results: dict[str, tuple[str, int]] = {}
    try:
        topics = bench.topics(events, f"{args.events}")
        warm_topics = bench.topics(warm, f"warm{args.warmup}") if args.warmup else topics
        log("warm-up (untimed): each engine runs each query once ...")
        for query in args.queries:
            for engine in engines_of(query):
                root = work / f"warm-{query}-{engine}"
                bench.once(engine, query, warm_topics, root, expected(warm, query))
                shutil.rmtree(root, ignore_errors=True)
        for i in range(args.rounds):
            for query in args.queries:
                order = engines_of(query) if i % 2 == 0 else engines_of(query)[::-1]
                for engine in order:
                    bench.measure(i, engine, query, topics, expected(events, query))
        for query in args.queries:
            log(f"comparing {query}'s results ...")
            results[query] = compare(bench, query, events)
    finally:
        spark.stop()
    report(bench, events, results, args)
    if any(not text.startswith("✓") for text, _ in results.values()):
        raise SystemExit(1)


def report(bench: Bench, events: nx_events.Events, results: dict[str, tuple[str, int]],
           args: argparse.Namespace) -> None:  # fmt: skip
    med = statistics.median
    header = ("query", "reads", "microbatch rec/s", "CPU-s", "Spark rec/s", "CPU-s", "mb ÷ Spark",
              "result", "rows", "mb ev/s/core", "Spark ev/s/core", "Flink")  # fmt: skip
    lines = []
    loads = []
    for query in args.queries:
        n = expected(events, query)
        cells = [query, f"{n:,}"]
        rates: dict[str, float] = {}
        per_core: dict[str, str] = {}
        for engine in ENGINES:
            xs = bench.runs.get((query, engine))
            if not xs:
                cells += ["cannot express" if engine == "spark" else "-", "-"]
                per_core[engine] = "-"
                continue
            loads += [float(where.split()[1].split("/")[0]) for _, _, where in xs]
            rates[engine] = n / med([s for s, _, _ in xs])
            best = n / min(s for s, _, _ in xs)
            cpu = med([c for _, c, _ in xs])
            cells += [f"{rates[engine]:,.0f} ({best:,.0f})", f"{cpu:.1f}"]
            per_core[engine] = f"{n / cpu:,.0f}"
        ratio = rates["microbatch"] / rates["spark"] if len(rates) == 2 else None
        text, rows = results.get(query, ("?", 0))
        cells += [f"{ratio:.2f}" if ratio else "-", text, f"{rows:,}", per_core["microbatch"],
                  per_core["spark"], f"{FLINK_PER_CORE[query]:,}"]  # fmt: skip
        lines.append(cells)
    widths = [max(len(str(r[i])) for r in [header, *lines]) for i in range(len(header))]
    print()
    for row in [header, ["-" * w for w in widths], *lines]:
        print("  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=True)))
    spread = f"{min(loads):.1f}–{max(loads):.1f}" if loads else "?"
    print(
        f"\n{events.events:,} Nexmark events ({events.counts}); {args.rounds} rounds, median "
        f"(best) records/s; CPU-s median; load at the runs' starts {spread} on "
        f"{os.cpu_count()} cpus. ev/s/core = records the query read ÷ CPU-s; Flink's "
        "figure counts every generated event (its source filters), so for q3/q8 (8% of the "
        "events) ours is conservative."
    )
    for query, reason in spark_queries.CANNOT.items():
        if query in args.queries:
            print(f"Spark cannot run {query}: {reason}.")
    ran = [q for q in args.queries if (q, "microbatch") in bench.runs]
    if not ran:
        return

    def wall(q: str) -> float:
        return med([s for s, _, _ in bench.runs[(q, "microbatch")]])

    slowest = min(ran, key=lambda q: expected(events, q) / wall(q))
    longest = max(ran, key=wall)
    for query, what in ((slowest, "fewest records/s"), (longest, "longest")):
        if query in bench.breakdown:
            print(f"\nWhere microbatch's time goes in {query} ({what}; round 1):")
            print("\n".join(bench.breakdown.pop(query)))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=count, default=count("200k"), help="e.g. 200k, 10M")
    parser.add_argument("--queries", default=",".join(queries.QUERIES),
                        help="comma-separated, e.g. q0,q5")  # fmt: skip
    parser.add_argument("--rounds", type=int, default=3)
    own = "events of warm-up topics of their own; 0: the topics themselves"
    parser.add_argument("--warmup", type=count, default=0, help=own)
    parser.add_argument("--partitions", type=int, default=4, help="partitions per topic")
    one, each = count_text(ONE_BATCH_UP_TO), count_text(BATCH_RECORDS)
    split = "records per batch (Spark: maxOffsetsPerTrigger per topic); default: one batch up "
    split += f"to {one} events, else {each}"
    parser.add_argument("--batch-records", type=count, default=None, help=split)
    columns = "microbatch decodes with the events' declared schemas (Arrow columns)"
    parser.add_argument("--schema", action="store_true", help=columns)
    parser.add_argument(
        "--reader",
        choices=("auto", "native", "confluent", "spark", "python"),
        default="auto",
        help="microbatch's KafkaSource(reader=...)",
    )
    heap = "the Spark JVM's heap (one session, both engines); default: 1g up to "
    heap += f"{one} events, else {BIG_HEAP} (Structured Streaming's q7 join outgrows 1g at 10M)"
    parser.add_argument("--driver-memory", default=None, help=heap)
    args = parser.parse_args(argv)
    if args.driver_memory is None:
        args.driver_memory = "1g" if args.events <= ONE_BATCH_UP_TO else BIG_HEAP
    args.queries = [q.strip() for q in args.queries.split(",") if q.strip()]
    unknown = [q for q in args.queries if q not in queries.QUERIES]
    if unknown:
        parser.error(f"unknown queries {unknown}; choose from {', '.join(queries.QUERIES)}")
    if args.events < 50 or args.rounds < 1:
        parser.error("--events must be >= 50 and --rounds >= 1")
    if args.batch_records is None and args.events > ONE_BATCH_UP_TO:
        args.batch_records = BATCH_RECORDS  # bounded memory per batch (records in Python)
        log(f"--events {args.events:,}: batches of {BATCH_RECORDS:,} records")
    with tempfile.TemporaryDirectory(prefix="bench-nexmark-") as tmp:
        work = Path(tmp)
        with kafka_settings(work, work / "home") as settings:
            run(settings, args, work)


if __name__ == "__main__":
    main()
