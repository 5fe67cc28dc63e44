"""End-to-end keyed pipeline: microbatch vs Spark Structured Streaming, same topic, one run.

Produces ``--records`` JSON events ``{"user_id": "user-<n % 10000>", "page": ..., "ts": ...}``
(~120 bytes each) into a fresh 4-partition topic, then on ONE SparkSession (``local[2]``,
built by ``microbatch.spark.spark_session`` with Spark's Kafka connector jars — resolved
with mvn by ``microbatch.localstack.spark_kafka``, as ``make jars`` does —
``spark.sql.shuffle.partitions`` = the pipeline's parallelism, 2) measures, each consuming
the whole topic in one batch:

- **microbatch**: ``Pipeline(KafkaSource(reader="spark"), Enrichment(zero-latency async
  pass-through, unordered, capacity 1000), key_by="user_id", a KeyedProcessFunction
  counting per user in value state and emitting {"user_id", "count"} per user,
  ParquetSink)``, parallelism 2, max_parallelism 128, checkpoints and sink in temporary
  folders; one ``BatchRunner.run``. Stage 1 reads the planned offset ranges with Spark's
  JVM Kafka source (the same connector as the reference), then decodes, enriches and keys
  in Python;
- **microbatch, confluent-kafka reader** (extra row): the same pipeline with
  ``KafkaSource(reader="confluent")``, librdkafka reading inside the stage-1 tasks
  (``bench_kafka_reader.py``);
- **microbatch, kafka-python reader** (extra row, not the target): the same pipeline with
  ``KafkaSource(reader="python")``, kafka-python reading inside the stage-1 tasks;
- **Structured Streaming** (the reference): the Kafka source (``spark-sql-kafka-0-10``),
  ``from_json``, ``groupBy("user_id").applyInPandasWithState`` (state = the count, output
  mode update), ``Trigger.AvailableNow``, ``foreachBatch`` appending Parquet, checkpoint
  in a temporary folder; timed from ``start()`` to ``awaitTermination()``. Its stateful
  operator runs ``spark.sql.shuffle.partitions`` tasks: 2, like microbatch's 2 operator
  instances (with the library's default of 8 it is ~1.5x slower on 2 cores);
- the wall time of an **empty microbatch batch** (the pipeline again, nothing new to read).

records/s = records / wall time of the batch (the session start is shared and excluded);
CPU-s = CPU time of this process, the Spark JVM and its Python workers during the run (the
Kafka broker's excluded). Both engines first run once, untimed, over a small warm-up topic
(``--warmup``), so neither pays the JVM's and the Python workers' one-time start-up inside
its measurement; ``--repeat N`` rotates the engines N times (fresh checkpoints each time)
and reports the ratio of their median runs (and of their best). Every run is printed with
the machine's load average, since a busy machine skews one engine's measurement more than
the other's. Target: microbatch / Structured Streaming ≥ 1.0. The final count of every
user must be equal in both outputs and sum to ``--records``; the table says whether they
match.

Uses the broker at ``MICROBATCH_KAFKA_BOOTSTRAP_SERVERS`` if set (e.g. ``make stack``),
else starts a Kafka broker on free loopback ports and stops it at the end.

``--stages`` turns on Spark's UI (off in the library's sessions) and prints, after each
run, the Spark stages it ran (wall, executor run and CPU time, shuffle bytes) from the
driver's REST API: where the time goes.

``--schema`` measures the keyed count with a declared value schema instead
(``KafkaSource(value_schema=JsonSchema({"user_id": "string", "page": "string", "ts":
"long"}))``, no enrichment, as the reference has none): stage 1 decodes each Arrow batch
of values with ``pyarrow.json`` and keys it per distinct key, stage 2 counts
``len(records)`` without building a record. Target then: ≥ 2.5 (issue #33). An extra row runs the
same keyed count without a schema (per-record JSON) and without enrichment: what the
schema itself buys.

``--sink delta`` writes microbatch's counts to a Delta table (``DeltaSink``) instead of
the Parquet sink: the end-to-end cost of the table sink, against the same reference.

    .venv/bin/python bench/bench_pipeline.py [--records 1000000 | --quick] [--repeat 1]
        [--no-python-reader] [--no-confluent-reader] [--sink parquet|delta] [--schema]
        [--stages]
"""

from __future__ import annotations

import argparse
import functools
import shutil
import statistics
import tempfile
import time
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import benchlib
import pyarrow as pa
import pyarrow.parquet as pq
from benchlib import finish_query, kafka_settings, load, log, print_table, spark_cpu_seconds

from microbatch.checkpoint import Layout, latest_manifest
from microbatch.enrich import AsyncOperator, NoRetry
from microbatch.localstack.spark_kafka import ensure_spark_kafka_jars
from microbatch.runtime import (
    BatchOptions,
    BatchResult,
    BatchRunner,
    Enrichment,
    KafkaSource,
    KeyedProcessFunction,
    ParquetSink,
    Pipeline,
    ProcessContext,
)
from microbatch.runtime.schema import JsonSchema
from microbatch.settings import Settings
from microbatch.sinks import read_parquet_sink
from microbatch.spark import spark_session
from microbatch.storage import open_store

REPO = Path(__file__).resolve().parents[1]
PARTITIONS = 4
USERS = 10_000
PARALLELISM = 2  # microbatch operator instances = Structured Streaming shuffle partitions
TS0 = 1_767_225_600_000  # 2026-01-01T00:00:00Z
EVENT_DDL = "user_id STRING, page STRING, ts LONG"
COUNT_SCHEMA = pa.schema([("user_id", pa.string()), ("count", pa.int64())])


# The microbatch pipeline (module level: pickled to the Spark workers) ------------------


class CountPerUser(KeyedProcessFunction):
    """The running count of a user in value state; one output row per user per batch."""

    def process(self, key: Any, records: Sequence[Any], ctx: ProcessContext) -> None:
        count = ctx.value("count")
        n = count.get(0) + len(records)
        count.set(n)
        ctx.emit({"user_id": key, "count": n})


async def passthrough(record: Any) -> Any:
    """A zero-latency in-process "service": the enrichment costs only its machinery."""
    return record


def make_operator() -> AsyncOperator:
    return AsyncOperator(
        passthrough,
        mode="unordered",
        capacity=1000,
        timeout_s=None,
        retry=NoRetry(),
        on_failure="fail",
    )


def make_sink(root: Path, kind: str) -> Any:
    """The microbatch pipeline's output: a Parquet sink, or (``--sink delta``) a Delta table."""
    if kind == "delta":
        from microbatch.sinks import DeltaSink

        return DeltaSink("counts", str(root / "counts"), COUNT_SCHEMA)
    return ParquetSink("counts", str(root / "counts"), COUNT_SCHEMA)


def read_sink(root: Path, kind: str, settings: Settings) -> pa.Table:
    if kind == "delta":
        from microbatch.sinks import read_delta_sink

        return read_delta_sink(str(root / "counts"), settings)
    return read_parquet_sink(str(root / "counts"), settings)


READER_NAMES = {"confluent": "confluent-kafka", "python": "kafka-python"}
EVENT_SCHEMA = JsonSchema({"user_id": "string", "page": "string", "ts": "long"})


def make_pipeline(
    name: str,
    topic: str,
    root: Path,
    reader: str = "spark",
    sink: str = "parquet",
    schema: bool = False,
    enrich: bool | None = None,
) -> Pipeline:
    """The keyed count; ``schema``: with a declared value schema; ``enrich``: through the
    pass-through enrichment (default: without a schema only)."""
    enrich = not schema if enrich is None else enrich
    return Pipeline(
        name=name,
        source=KafkaSource(
            topics=(topic,),
            starting="earliest",
            reader=reader,  # type: ignore[arg-type]
            value_schema=EVENT_SCHEMA if schema else None,
        ),
        enrich=Enrichment(make_operator) if enrich else None,
        key_by="user_id",
        process=CountPerUser(),
        sinks=[make_sink(root, sink)],
        checkpoints=str(root / "checkpoints"),
        max_parallelism=128,
        parallelism=PARALLELISM,
    )


# The Structured Streaming reference -----------------------------------------------------


def count_users(key: tuple[str], pdfs: Iterator[Any], state: Any) -> Iterator[Any]:
    """applyInPandasWithState body: state = (count,); emits the user's new count."""
    import pandas as pd

    n = state.get[0] if state.exists else 0
    for pdf in pdfs:
        n += len(pdf)
    state.update((n,))
    yield pd.DataFrame({"user_id": [key[0]], "count": [n]})


def run_structured_streaming(spark: Any, bootstrap: str, topic: str, root: Path) -> float:
    from pyspark.sql import functions as F
    from pyspark.sql.streaming.state import GroupStateTimeout

    out = str(root / "counts")
    events = (
        spark.readStream.format("kafka")
        .option("kafka.bootstrap.servers", bootstrap)
        .option("subscribe", topic)
        .option("startingOffsets", "earliest")
        .option("failOnDataLoss", "true")
        .load()
        .select(F.from_json(F.col("value").cast("string"), EVENT_DDL).alias("e"))
        .select("e.*")
    )  # fmt: skip
    counts = events.groupBy("user_id").applyInPandasWithState(
        count_users,
        outputStructType="user_id STRING, count LONG",
        stateStructType="count LONG",
        outputMode="update",
        timeoutConf=GroupStateTimeout.NoTimeout,
    )

    def write(batch: Any, batch_id: int) -> None:
        batch.write.mode("append").parquet(out)

    started = time.perf_counter()
    query = (
        counts.writeStream.outputMode("update")
        .foreachBatch(write)
        .trigger(availableNow=True)
        .option("checkpointLocation", str(root / "checkpoint"))
        .start()
    )
    return finish_query(query, started)


# Set-up: topic, data; CPU accounting --------------------------------------------------------


def event(n: int) -> bytes:
    return (
        f'{{"user_id": "user-{n % USERS}", '
        f'"page": "/products/category-{n % 37:02d}/item-{n % 99_991:06d}?ref=home&s={n:08x}", '
        f'"ts": {TS0 + n * 10}}}'
    ).encode()


def produce(bootstrap: str, topic: str, n: int) -> None:
    benchlib.produce(bootstrap, topic, n, event, PARTITIONS)


# Measurements ----------------------------------------------------------------------------


def run_microbatch(spark: Any, settings: Settings, pipeline: Pipeline) -> tuple[float, BatchResult]:
    started = time.perf_counter()
    runner = BatchRunner(spark, pipeline, settings)
    result = runner.run(BatchOptions(run_id="bench"))
    wanted = pipeline.source.reader
    if result.records_in and runner.stage_one_reader != wanted:
        raise SystemExit(f"stage 1 read with {runner.stage_one_reader!r}, not {wanted!r}")
    return time.perf_counter() - started, result


def _spark_stages(spark: Any) -> list[dict[str, Any]]:
    """The application's completed stages from the driver's REST API (empty if it has
    no UI)."""
    import json
    import urllib.request

    url = spark.sparkContext.uiWebUrl
    if not url:
        return []
    app = spark.sparkContext.applicationId
    with urllib.request.urlopen(f"{url}/api/v1/applications/{app}/stages?status=complete") as r:
        return json.load(r)  # type: ignore[no-any-return]


def spark_stage_ids(spark: Any) -> set[int]:
    return {s["stageId"] for s in _spark_stages(spark)}


def log_spark_stages(spark: Any, before: set[int]) -> None:
    """The stages a run added: wall time, executor run/CPU time, records, shuffle."""
    import datetime as dt

    def at(stamp: str) -> float:
        return dt.datetime.strptime(stamp, "%Y-%m-%dT%H:%M:%S.%f%Z").timestamp()

    for s in sorted(_spark_stages(spark), key=lambda s: s["stageId"]):
        if s["stageId"] in before:
            continue
        wall = at(s["completionTime"]) - at(s["submissionTime"])
        log(
            f"    stage {s['stageId']} ({s['numTasks']} tasks, {s['name'][:40]}): "
            f"{wall:.2f} s wall, {s['executorRunTime'] / 1000:.2f} s run, "
            f"{s['executorCpuTime'] / 1e9:.2f} s CPU, "
            f"{s['inputRecords'] or s['shuffleReadRecords']:,} records in, "
            f"shuffle write {s['shuffleWriteBytes'] / 1e6:.1f} MB, "
            f"read {s['shuffleReadBytes'] / 1e6:.1f} MB"
        )


def final_counts(table: pa.Table) -> dict[str, int]:
    """Per user, the largest count emitted (the running count only grows)."""
    agg = table.group_by("user_id").aggregate([("count", "max")])
    return dict(
        zip(agg.column("user_id").to_pylist(), agg.column("count_max").to_pylist(), strict=True)
    )


def compare(mb: dict[str, int], ss: dict[str, int], records: int) -> tuple[bool, str]:
    users = min(records, USERS)
    problems = []
    for label, counts in (("microbatch", mb), ("structured streaming", ss)):
        if sum(counts.values()) != records or len(counts) != users:
            problems.append(f"{label}: {len(counts):,} users summing to {sum(counts.values()):,}")
    differ = sorted(u for u in mb.keys() | ss.keys() if mb.get(u) != ss.get(u))
    if differ:
        sample = ", ".join(f"{u}: {mb.get(u)} vs {ss.get(u)}" for u in differ[:5])
        problems.append(f"{len(differ):,} users differ ({sample})")
    if problems:
        return False, "; ".join(problems)
    return True, f"{users:,} users, counts sum to {records:,} in both"


#: (wall seconds, CPU seconds, load average at the start) of one measured run.
Run = tuple[float, float, str]


def run(settings: Settings, args: argparse.Namespace, work: Path) -> None:
    bootstrap = settings.kafka_bootstrap_servers
    tag = uuid.uuid4().hex[:8]
    topic, warm_topic = f"bench-pipeline-{tag}", f"bench-pipeline-warmup-{tag}"
    log(f"producing {args.records:,} events to {topic} ({PARTITIONS} partitions) on {bootstrap}")
    produce(bootstrap, topic, args.records)
    if args.warmup:
        produce(bootstrap, warm_topic, args.warmup)

    jars = ensure_spark_kafka_jars(settings.home_path)  # spark_session puts them on spark.jars
    log(f"starting Spark local[2] with {', '.join(j.name for j in jars)}")
    conf = {"spark.sql.shuffle.partitions": str(PARALLELISM)}
    if args.stages:
        conf |= {"spark.ui.enabled": "true", "spark.ui.port": "0"}
    spark = spark_session(settings, "bench-pipeline", conf=conf)
    runs: dict[str, list[Run]] = {"spark": [], "python": [], "confluent": [], "ss": [], "plain": []}
    empty: list[float] = []
    try:
        if args.warmup:
            log(f"warm-up (untimed): each engine over {args.warmup:,} records ...")
            for reader in ("spark", *args.extra_readers):
                warm = make_pipeline(
                    f"warm-{reader}-{tag}",
                    warm_topic,
                    work / f"w-{reader}",
                    reader,
                    args.sink,
                    args.schema,
                )
                run_microbatch(spark, settings, warm)
            run_structured_streaming(spark, bootstrap, warm_topic, work / "w-ss")

        def microbatch_run(i: int, reader: str) -> None:
            """``reader`` "plain": the Spark reader, no schema, no enrichment."""
            before, cpu = load(), spark_cpu_seconds(spark)
            log(f"[{i + 1}] microbatch ({reader} reader): one batch over the topic ({before}) ...")
            plain = reader == "plain"
            pipeline = make_pipeline(
                f"bench-{reader}-{tag}-{i}",
                topic,
                work / f"{reader}{i}",
                "spark" if plain else reader,
                args.sink,
                args.schema and not plain,
                enrich=False if plain else None,
            )
            stages_before = spark_stage_ids(spark)
            seconds, result = run_microbatch(spark, settings, pipeline)
            cpu = spark_cpu_seconds(spark) - cpu
            log_spark_stages(spark, stages_before)
            runs[reader].append((seconds, cpu, before))
            log(f"  {seconds:.2f} s, {cpu:.1f} CPU-s; phases {result.seconds}")
            if result.records_in != args.records:
                raise SystemExit(f"microbatch read {result.records_in:,} of {args.records:,}")
            manifest = latest_manifest(open_store(pipeline.checkpoints, settings), Layout())
            for inst in manifest.metadata["stats"]["instances"] if manifest else []:
                log(
                    f"    instance {inst['instance']}: {inst.get('records', 0):,} records, "
                    f"{inst.get('keys', 0):,} keys, seconds {inst['seconds']}"
                )
            if i == 0 and reader == "spark":
                log("  empty batches of the same pipeline (nothing new to read) ...")
                for _ in range(args.empty_runs):
                    seconds, empty_result = run_microbatch(spark, settings, pipeline)
                    if empty_result.records_in:
                        raise SystemExit(f"an empty batch read {empty_result.records_in}")
                    empty.append(seconds)
                    log(f"    {seconds:.2f} s; phases {empty_result.seconds}")

        def streaming_run(i: int) -> None:
            before, cpu = load(), spark_cpu_seconds(spark)
            log(f"[{i + 1}] Structured Streaming: AvailableNow over the whole topic ({before}) ...")
            stages_before = spark_stage_ids(spark)
            seconds = run_structured_streaming(spark, bootstrap, topic, work / f"ss{i}")
            cpu = spark_cpu_seconds(spark) - cpu
            log_spark_stages(spark, stages_before)
            runs["ss"].append((seconds, cpu, before))
            log(f"  {seconds:.2f} s, {cpu:.1f} CPU-s")

        measures: list[Any] = [
            lambda i: microbatch_run(i, "spark"),
            streaming_run,
            *(functools.partial(microbatch_run, reader=r) for r in args.extra_readers),
            *([lambda i: microbatch_run(i, "plain")] if args.schema else []),
        ]
        for i in range(args.repeat):  # rotate the order: load swings hit every engine alike
            for k in range(len(measures)):
                measures[(i + k) % len(measures)](i)

        mb_counts = final_counts(read_sink(work / "spark0", args.sink, settings))
        ss_counts = final_counts(pq.read_table(str(work / "ss0" / "counts")))
        other_counts = {
            r: final_counts(read_sink(work / f"{r}0", args.sink, settings))
            for r in args.extra_readers
        }
    finally:
        spark.stop()

    match, detail = compare(mb_counts, ss_counts, args.records)
    for reader, counts in other_counts.items():
        if counts != mb_counts:
            match, detail = False, f"the {reader} reader's counts differ; {detail}"
    # Ratios are of medians (of the best runs too, as a second figure): one lucky or
    # unlucky run on a shared 2-core machine says little.
    done = {name: [r[0] for r in xs] for name, xs in runs.items() if xs}
    rate = {name: args.records / statistics.median(walls) for name, walls in done.items()}
    best = {name: args.records / min(walls) for name, walls in done.items()}

    def described(xs: list[Run]) -> str:
        listed = "; ".join(f"{s:.2f} s, {cpu:.1f} CPU-s ({where} at start)" for s, cpu, where in xs)
        return (f"median of {len(xs)}: " if len(xs) > 1 else "") + listed

    what = "declared schema, keyed count" if args.schema else "enrich + keyed count"
    target = 2.5 if args.schema else 1.0
    rows = [
        (
            f"microbatch (JVM Kafka reader, {what}, P={PARALLELISM})",
            f"{rate['spark']:,.0f}/s",
            described(runs["spark"]),
        ),
        (
            "Structured Streaming (applyInPandasWithState)",
            f"{rate['ss']:,.0f}/s",
            f"reference; {PARALLELISM} shuffle partitions; sink foreachBatch → Parquet; "
            + described(runs["ss"]),
        ),
        (
            "microbatch / Structured Streaming",
            f"{rate['spark'] / rate['ss']:.3f}",
            f"medians; target ≥ {target}: "
            f"{'met' if rate['spark'] >= target * rate['ss'] else 'NOT met'}; "
            f"bests: {best['spark']:,.0f}/s ÷ {best['ss']:,.0f}/s = "
            f"{best['spark'] / best['ss']:.3f}",
        ),
    ]
    if args.schema:
        plain_counts = final_counts(read_sink(work / "plain0", args.sink, settings))
        if plain_counts != mb_counts:
            match, detail = False, f"the pipeline without a schema counts otherwise; {detail}"
        rows += [
            (
                "microbatch without a schema (per-record JSON, no enrichment)",
                f"{rate['plain']:,.0f}/s",
                f"{rate['plain'] / rate['ss']:.2f} of Structured Streaming; "
                + described(runs["plain"]),
            )
        ]
    for reader in args.extra_readers:
        ratio = rate[reader] / rate["ss"]
        mark = f" (target ≥ {target}: {'met' if ratio >= target else 'NOT met'})"
        rows += [
            (
                f"microbatch, {READER_NAMES[reader]} reader",
                f"{rate[reader]:,.0f}/s",
                f"{ratio:.2f} of Structured Streaming{mark if reader == 'confluent' else ''}; "
                + described(runs[reader]),
            )
        ]
    rows += [
        (
            "empty microbatch batch",
            f"{statistics.median(empty):.2f} s",
            f"median of {len(empty)}: " + ", ".join(f"{s:.2f}" for s in empty),
        ),
        ("final counts per user", "match" if match else "MISMATCH", detail),
    ]
    print_table(rows)
    if not match:
        raise SystemExit(1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--records", type=int, default=1_000_000)
    parser.add_argument("--quick", action="store_true", help="100,000 records")
    parser.add_argument("--warmup", type=int, default=20_000, help="records; 0: no warm-up")
    parser.add_argument("--empty-runs", type=int, default=3)
    parser.add_argument("--repeat", type=int, default=1, help="runs of each engine; best counts")
    parser.add_argument(
        "--sink",
        choices=("parquet", "delta"),
        default="parquet",
        help="microbatch's output: the Parquet sink, or a Delta table (DeltaSink)",
    )
    parser.add_argument(
        "--stages", action="store_true", help="Spark's UI on; print each run's Spark stages"
    )
    parser.add_argument(
        "--schema",
        action="store_true",
        help="the keyed count with a declared value schema (no enrichment); target 2.5",
    )
    parser.add_argument(
        "--no-python-reader",
        dest="python_reader",
        action="store_false",
        help="skip the extra row of microbatch with its kafka-python reader",
    )
    parser.add_argument(
        "--no-confluent-reader",
        dest="confluent_reader",
        action="store_false",
        help="skip the extra row of microbatch with its confluent-kafka reader",
    )
    args = parser.parse_args()
    args.extra_readers = tuple(
        r for r, on in (("confluent", args.confluent_reader), ("python", args.python_reader)) if on
    )
    if args.quick:
        args.records = 100_000
    work = Path(tempfile.mkdtemp(prefix="bench-pipeline-"))
    try:
        with kafka_settings(work, REPO / ".local") as settings:
            run(settings, args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
