"""Kafka range readers: records/s and CPU-s of the ways stage 1 gets planned ranges into Arrow.

Produces ``--records`` JSON records (~150-byte values, 10-byte keys) into a fresh
single-partition topic and as many into a fresh 4-partition topic, then measures:

**One partition, one process, one core** (no Spark):

- a raw kafka-python loop: ``assign`` + ``seek_to_beginning`` + ``poll`` until the end,
  counting records — once with kafka-python's default fetch settings and once with the
  reader's fetch settings (the fair reference: same bytes per round trip);
- :func:`microbatch.kafka.read_range` over the same offsets, building Arrow batches
  (target: ≥ 0.8 × the raw loop with the same fetch settings);
- :func:`microbatch.kafka.read_range_confluent`: the same range, the same Arrow batches,
  read by confluent-kafka (librdkafka, the standard C client);
- :func:`microbatch.kafka.read_range_native`: the same again, read by microbatch's native
  reader (librdkafka's messages into Arrow buffers in Rust, ``libs/microbatch-native``).

**Four partitions, the ways stage 1 can read a batch's planned ranges** (one range per
partition; CPU-s = CPU time of every process involved, the broker's excluded):

- ``read_range`` in this process, the ranges one after the other (kafka-python);
- ``read_range_confluent`` and ``read_range_native`` in this process, likewise;
- Spark's JVM Kafka source (:func:`microbatch.kafka.read_ranges_spark`, today's default
  ``KafkaSource(reader="spark")``) then a ``mapInArrow`` over ``select("topic",
  "partition", "offset", "key", "value")`` that counts rows: the JVM fetches and parses,
  Python receives Arrow batches. CPU-s: this process + the Spark JVM + its Python workers
  (``benchlib.spark_cpu_seconds``);
- ``read_range`` inside the ``mapInArrow`` tasks over ``range_descriptors`` (today's
  ``KafkaSource(reader="python")``, as ``execute.read_planned`` runs it), counting rows in
  the same Python worker (nothing goes back to the JVM);
- ``read_range_confluent`` and ``read_range_native`` inside those tasks, likewise
  (``KafkaSource(reader="confluent")`` and ``"native"``, as ``execute.read_planned`` runs
  them);
- below the table, a job of the same tasks reading nothing: the fixed cost of a Spark job
  that every Spark row includes.

Spark: ``microbatch.spark.spark_session`` on ``local[2]`` with the Kafka connector jars
(``make jars``), one task per range. Every reader first runs once untimed over the whole
batch computing, per partition, the count, first/last offset and a SHA-256 of the offsets,
keys and values in offset order (also the warm-up); the bench fails unless all agree.
Then ``--repeat`` rounds rotate the readers' order; each run prints the load average at its
start; the table shows median and best, and the ratios of the medians against the JVM path
(records/s, and records per CPU-second).

``read_range_confluent`` and ``read_range_native`` (``microbatch.kafka.confluent_reader``
says how) return exactly what ``read_range`` returns; the bench checks that again on its
data.

Uses the broker at ``MICROBATCH_KAFKA_BOOTSTRAP_SERVERS`` if set (e.g. ``make stack``),
else starts a Kafka broker on free loopback ports and stops it at the end.

    .venv/bin/python bench/bench_kafka_reader.py [--records 1000000] [--repeat 3]
        [--no-single-partition] [--no-spark]
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import os
import statistics
import tempfile
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from benchlib import kafka_settings, load, log, spark_cpu_seconds

from microbatch.kafka import (
    OffsetRange,
    read_range,
    read_range_confluent,
    read_range_native,
    read_ranges_spark,
)
from microbatch.kafka.reader import build_consumer_config, range_descriptors

REPO = Path(__file__).resolve().parents[1]
PARTITIONS = 4
USERS = 10_000
TS0 = 1_767_225_600_000  # 2026-01-01T00:00:00Z
PAGES = ("/", "/products", "/products/42", "/cart", "/checkout", "/search?q=kafka", "/help")

# The data ------------------------------------------------------------------------------------


def event(i: int) -> tuple[bytes, bytes]:
    """Record ``i``: a 10-byte key and a ~150-byte JSON value, all different."""
    value = {
        "user_id": f"user-{(i * 7919) % USERS:05d}",
        "session": f"{(i * 2654435761) % 2**32:08x}",
        "page": PAGES[i % len(PAGES)],
        "ts": TS0 + i * 13,
        "amount_cents": (i * 37) % 100_000,
        "referrer": f"https://shop.example/campaign/{i % 97}",
    }
    return b"key-%06d" % (i % 1_000_000), json.dumps(value, separators=(",", ":")).encode()


def produce(bootstrap: str, topic: str, n: int, partitions: int) -> int:
    """Create ``topic`` and send ``event(i)`` to partition ``i % partitions``; the bytes of
    all values. The producer is librdkafka's (fast, not measured)."""
    from confluent_kafka import Producer
    from confluent_kafka.admin import AdminClient, NewTopic

    admin = AdminClient({"bootstrap.servers": bootstrap})
    for future in admin.create_topics([NewTopic(topic, partitions, 1)]).values():
        future.result()
    producer = Producer(
        {
            "bootstrap.servers": bootstrap,
            "acks": 1,
            "linger.ms": 50,
            "queue.buffering.max.messages": 500_000,
            "enable.idempotence": False,
        }
    )
    started, size = time.monotonic(), 0
    for i in range(n):
        key, value = event(i)
        size += len(value)
        while True:
            try:
                producer.produce(topic, value=value, key=key, partition=i % partitions)
                break
            except BufferError:
                producer.poll(0.05)
    if producer.flush(120):
        raise SystemExit(f"{topic}: records still unsent after 120 s")
    elapsed = time.monotonic() - started
    log(f"  {topic}: {n:,} records in {partitions} partitions, {elapsed:.1f} s ({load()})")
    return size


def end_offsets(bootstrap: str, topic: str, partitions: int) -> list[OffsetRange]:
    """One range per partition, from the start to the last stable offset."""
    from kafka import KafkaConsumer, TopicPartition

    probe = KafkaConsumer(bootstrap_servers=bootstrap, isolation_level="read_committed")
    try:
        tps = [TopicPartition(topic, p) for p in range(partitions)]
        ends = probe.end_offsets(tps)
    finally:
        probe.close()
    return [OffsetRange(topic, tp.partition, 0, ends[tp]) for tp in tps]


# Same records: a digest per partition ---------------------------------------------------------

#: partition → (records, first offset, last offset, SHA-256 of offsets, keys and values).
Digest = dict[int, tuple[int, int, int, str]]
DIGEST_DDL = "partition int, records long, first long, last long, sha string"


def _hash_binary(h: Any, column: pa.Array) -> None:
    """Lengths (-1: null) and bytes of a binary column, whatever its slicing."""
    column = column.cast(pa.binary())
    h.update(pc.binary_length(column).fill_null(-1).to_numpy().astype("<i8").tobytes())
    _, offsets_buffer, data = column.buffers()
    offsets = np.frombuffer(offsets_buffer, "<i4", len(column) + 1, column.offset * 4)
    if data is not None:
        h.update(memoryview(data)[offsets[0] : offsets[-1]])


def digest_batches(batches: Iterable[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    """One row per partition (``DIGEST_DDL``) over rows with partition, offset, key, value;
    offsets must increase within a partition (every reader reads a range in order)."""
    state: dict[int, list[Any]] = {}  # partition → [records, first, last, sha]
    for batch in batches:
        parts = batch.column("partition")
        for part in pc.unique(parts).to_pylist():
            rows = batch.filter(pc.equal(parts, part)) if len(pc.unique(parts)) > 1 else batch
            offsets = rows.column("offset").to_numpy()
            entry = state.setdefault(part, [0, int(offsets[0]), -1, hashlib.sha256()])
            if offsets[0] <= entry[2] or (np.diff(offsets) <= 0).any():
                raise SystemExit(f"partition {part}: offsets out of order near {offsets[0]}")
            entry[0] += len(offsets)
            entry[2] = int(offsets[-1])
            entry[3].update(offsets.astype("<i8").tobytes())
            _hash_binary(entry[3], rows.column("key"))
            _hash_binary(entry[3], rows.column("value"))
    yield pa.RecordBatch.from_pylist(
        [
            {"partition": p, "records": n, "first": a, "last": b, "sha": h.hexdigest()}
            for p, (n, a, b, h) in sorted(state.items())
        ],
        schema=pa.schema(
            [
                ("partition", pa.int32()),
                ("records", pa.int64()),
                ("first", pa.int64()),
                ("last", pa.int64()),
                ("sha", pa.string()),
            ]
        ),
    )


def as_digest(rows: Iterable[Mapping[str, Any]]) -> Digest:
    out: Digest = {}
    for row in rows:
        if row["partition"] in out:
            raise SystemExit(f"partition {row['partition']} came from two Spark tasks")
        out[row["partition"]] = (row["records"], row["first"], row["last"], row["sha"])
    return out


def count_rows(batches: Iterable[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    """The timed runs' consumer of the records: counts them (one row out)."""
    yield pa.RecordBatch.from_pydict({"n": [sum(b.num_rows for b in batches)]})


# One partition, one core (the original rows, plus the librdkafka readers) ---------------------


def raw_loop(topic: str, end: int, config: dict[str, Any], value_bytes: int) -> int:
    """The reference: the tightest plain consumer loop, touching every record."""
    from kafka import KafkaConsumer, TopicPartition

    consumer = KafkaConsumer(**config)
    tp = TopicPartition(topic, 0)
    n = 0
    size = 0
    try:
        consumer.assign([tp])
        consumer.seek_to_beginning(tp)
        while consumer.position(tp) < end:
            for record in consumer.poll(timeout_ms=500, max_records=10_000).get(tp, ()):
                n += 1
                size += len(record.value)
    finally:
        consumer.close(autocommit=False)
    if size != value_bytes:
        raise SystemExit(f"the raw loop read {size:,} value bytes, expected {value_bytes:,}")
    return n


def count_reader(batches: Iterable[pa.RecordBatch]) -> int:
    return sum(batch.num_rows for batch in batches)


#: (wall seconds, CPU seconds, load average at the start) of one run.
Run = tuple[float, float, float]


def timed_in_process(fn: Callable[[], int], expected: int) -> Run:
    """Wall and CPU seconds (this process, every thread: librdkafka's too) of ``fn``."""
    before = os.getloadavg()[0]
    cpu, wall = time.process_time(), time.perf_counter()
    n = fn()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    if n != expected:
        raise SystemExit(f"read {n:,} records, expected {expected:,}")
    return wall, cpu, before


def single_partition(bootstrap: str, records: int, repeat: int) -> None:
    topic = f"bench-reader-{uuid.uuid4().hex[:8]}"
    log(f"producing {records:,} records to {topic} (1 partition) on {bootstrap} ...")
    value_bytes = produce(bootstrap, topic, records, 1)
    (whole,) = end_offsets(bootstrap, topic, 1)
    base = {
        "bootstrap_servers": bootstrap,
        "enable_auto_commit": False,
        "isolation_level": "read_committed",
        "auto_offset_reset": "earliest",
    }
    tuned = {**build_consumer_config(bootstrap), "auto_offset_reset": "earliest"}
    readers: dict[str, Callable[[], int]] = {
        "raw loop, default fetch settings": lambda: raw_loop(topic, whole.end, base, value_bytes),
        "raw loop, reader fetch settings": lambda: raw_loop(topic, whole.end, tuned, value_bytes),
        "read_range → Arrow batches": lambda: count_reader(read_range(bootstrap, whole)),
        "read_range_confluent → Arrow": lambda: count_reader(
            read_range_confluent(bootstrap, whole)
        ),
        "read_range_native → Arrow": lambda: count_reader(read_range_native(bootstrap, whole)),
    }
    runs: dict[str, list[Run]] = {label: [] for label in readers}
    print("one partition, one process, one core (runs alternate so load swings hit all alike):")
    for i in range(repeat):
        for label, fn in readers.items():
            runs[label].append(timed_in_process(fn, records))
            wall, cpu, before = runs[label][-1]
            print(
                f"  run {i + 1}  {label:<34} {records / wall:>10,.0f} records/s  "
                f"{cpu:5.2f} CPU-s  (load {before:.1f} at start)",
                flush=True,
            )
    rates = {label: [records / w for w, _, _ in xs] for label, xs in runs.items()}
    raw_default, raw_tuned, ours, confluent, native = (max(r) for r in rates.values())

    def paired_median(a: str, b: str) -> float:
        return statistics.median(x / y for x, y in zip(rates[a], rates[b], strict=True))

    def cpu_per_million(label: str) -> str:
        cpus = sorted(c for _, c, _ in runs[label])
        return f"{statistics.median(cpus) * 1e6 / records:.2f} CPU-s/1M (median)"

    rows = [
        ("raw kafka-python loop (defaults)", f"{raw_default:,.0f}/s", ""),
        ("raw kafka-python loop (same fetch)", f"{raw_tuned:,.0f}/s", "reference"),
        ("read_range (Arrow)", f"{ours:,.0f}/s", cpu_per_million("read_range → Arrow batches")),
        (
            "read_range / raw (same fetch), best",
            f"{ours / raw_tuned:.2f}",
            "target ≥ 0.8",
        ),
        (
            "  same, median of paired runs",
            f"{paired_median('read_range → Arrow batches', 'raw loop, reader fetch settings'):.2f}",
            "",
        ),
        ("read_range / raw (defaults)", f"{ours / raw_default:.2f}", "informational"),
        (
            "read_range_confluent (Arrow)",
            f"{confluent:,.0f}/s",
            cpu_per_million("read_range_confluent → Arrow"),
        ),
        (
            "confluent / read_range, median of paired runs",
            f"{paired_median('read_range_confluent → Arrow', 'read_range → Arrow batches'):.2f}",
            "records/s",
        ),
        (
            "read_range_native (Arrow)",
            f"{native:,.0f}/s",
            cpu_per_million("read_range_native → Arrow"),
        ),
        (
            "native / confluent, median of paired runs",
            f"{paired_median('read_range_native → Arrow', 'read_range_confluent → Arrow'):.2f}",
            "records/s",
        ),
    ]
    w0 = max(len(r[0]) for r in rows)
    w1 = max(len(r[1]) for r in rows)
    print(f"\n{'metric':<{w0}}  {'value':>{w1}}  notes")
    print(f"{'-' * w0}  {'-' * w1}  {'-' * 14}")
    for name, value, note in rows:
        print(f"{name:<{w0}}  {value:>{w1}}  {note}")
    print()


# Four partitions: the ways stage 1 can read a batch ------------------------------------------

SOURCE_COLUMNS = ("topic", "partition", "offset", "key", "value")
JVM = "JVM Kafka source → mapInArrow"


def four_partitions(settings: Any, records: int, repeat: int) -> None:
    from microbatch.kafka.reader import read_descriptors
    from microbatch.localstack.spark_kafka import ensure_spark_kafka_jars
    from microbatch.spark import spark_session

    bootstrap = settings.kafka_bootstrap_servers
    topic = f"bench-reader-{PARTITIONS}p-{uuid.uuid4().hex[:8]}"
    log(f"producing {records:,} records to {topic} ({PARTITIONS} partitions) ...")
    produce(bootstrap, topic, records, PARTITIONS)
    ranges = end_offsets(bootstrap, topic, PARTITIONS)
    jars = ensure_spark_kafka_jars(settings.home_path)  # spark_session puts them on spark.jars
    log(f"starting Spark local[2] with {', '.join(j.name for j in jars)}")
    spark = spark_session(settings, "bench-kafka-reader")

    def in_process(read: Callable[[str, OffsetRange], Iterator[pa.RecordBatch]]) -> Any:
        def batches() -> Iterator[pa.RecordBatch]:
            for r in ranges:
                yield from read(bootstrap, r)

        return (
            lambda: count_reader(batches()),
            lambda: as_digest(next(digest_batches(batches())).to_pylist()),
        )

    def in_spark(job: Callable[[Callable[..., Any], str], Any]) -> Any:
        """``job(consume, ddl)``: the DataFrame whose Python tasks hand the records to
        ``consume`` (``count_rows`` when timed, ``digest_batches`` to verify)."""
        return (
            lambda: sum(row["n"] for row in job(count_rows, "n long").collect()),
            lambda: as_digest(r.asDict() for r in job(digest_batches, DIGEST_DDL).collect()),
        )

    def in_tasks(read: Callable[[Iterable[pa.RecordBatch], str], Iterator[pa.RecordBatch]]) -> Any:
        """Reading and consuming in one Python worker, as ``ReadingStageOne`` does."""
        return in_spark(
            lambda consume, ddl: range_descriptors(spark, ranges).mapInArrow(
                lambda descriptors: consume(read(descriptors, bootstrap)), ddl
            )
        )

    readers: dict[str, tuple[bool, Any]] = {  # label → (in Spark, (timed, verify))
        JVM: (
            True,
            in_spark(
                lambda consume, ddl: (
                    read_ranges_spark(spark, bootstrap, ranges)
                    .select(*SOURCE_COLUMNS)
                    .mapInArrow(consume, ddl)
                )
            ),
        ),
        "kafka-python read_range in tasks": (True, in_tasks(read_descriptors)),
        "confluent reader in tasks": (
            True,
            in_tasks(functools.partial(read_descriptors, client="confluent")),
        ),
        "native reader in tasks": (
            True,
            in_tasks(functools.partial(read_descriptors, client="native")),
        ),
        "kafka-python read_range, 1 process": (False, in_process(read_range)),
        "confluent reader, 1 process": (False, in_process(read_range_confluent)),
        "native reader, 1 process": (False, in_process(read_range_native)),
    }
    runs: dict[str, list[Run]] = {label: [] for label in readers}
    try:
        log("untimed first run of each reader (warm-up): the digest of what it read ...")
        digests = {}
        for label, (_, (_, verify)) in readers.items():
            started = time.perf_counter()
            digests[label] = verify()
            log(f"  {label}: {time.perf_counter() - started:.1f} s")
        reference = digests[JVM]
        if sum(n for n, *_ in reference.values()) != records:
            raise SystemExit(f"the JVM source read {reference}, expected {records:,} records")
        for label, got in digests.items():
            if got != reference:
                raise SystemExit(
                    f"{label} read other records than the JVM source:\n  {got}\n  {reference}"
                )
        print(
            f"\n{PARTITIONS} partitions: all readers read the same records "
            f"(per partition: count, offsets, SHA-256 of offsets, keys, values)"
        )
        labels = list(readers)
        idle: list[Run] = []  # a job of the same tasks reading nothing: Spark's fixed cost
        for i in range(repeat):
            idle.append(
                timed_spark(
                    spark,
                    lambda: len(
                        range_descriptors(spark, ranges).mapInArrow(count_rows, "n long").collect()
                    ),
                    PARTITIONS,
                )
            )
            for k in range(len(labels)):
                label = labels[(i + k) % len(labels)]
                in_spark_, (timed, _) = readers[label]
                runs[label].append(
                    timed_spark(spark, timed, records)
                    if in_spark_
                    else timed_in_process(timed, records)
                )
                wall, cpu, before = runs[label][-1]
                print(
                    f"  round {i + 1}  {label:<36} {records / wall:>10,.0f} records/s  "
                    f"{cpu:5.2f} CPU-s  (load {before:.1f} at start)",
                    flush=True,
                )
    finally:
        spark.stop()
    print_runs(runs, records)
    print(
        f"inside each Spark row: a job of the same {PARTITIONS} tasks reading nothing costs "
        f"{statistics.median(w for w, _, _ in idle):.2f} s, "
        f"{statistics.median(c for _, c, _ in idle):.2f} CPU-s (medians)"
    )


def timed_spark(spark: Any, fn: Callable[[], int], expected: int) -> Run:
    """Wall and CPU seconds (this process, the Spark JVM, its Python workers) of ``fn``."""
    before = os.getloadavg()[0]
    cpu, wall = spark_cpu_seconds(spark), time.perf_counter()
    n = fn()
    wall, cpu = time.perf_counter() - wall, spark_cpu_seconds(spark) - cpu
    if n != expected:
        raise SystemExit(f"read {n:,} records, expected {expected:,}")
    return wall, cpu, before


def print_runs(runs: dict[str, list[Run]], records: int) -> None:
    def median(label: str, i: int) -> float:
        return statistics.median(run[i] for run in runs[label])

    def best(label: str, i: int) -> float:
        return min(run[i] for run in runs[label])

    per_m = 1e6 / records
    header = (
        "reader",
        "records/s med",
        "best",
        "CPU-s/1M med",
        "best",
        "rate ÷ JVM",
        "rec/CPU-s ÷ JVM",
    )
    rows = [header]
    for label in runs:
        rows.append(
            (
                label,
                f"{records / median(label, 0):,.0f}",
                f"{records / best(label, 0):,.0f}",
                f"{median(label, 1) * per_m:.2f}",
                f"{best(label, 1) * per_m:.2f}",
                f"{median(JVM, 0) / median(label, 0):.2f}",
                f"{median(JVM, 1) / median(label, 1):.2f}",
            )
        )
    widths = [max(len(row[c]) for row in rows) for c in range(len(header))]
    print(
        f"\n{records:,} records, {PARTITIONS} partitions (Spark readers: local[2], one task "
        "per partition; 1 process: the ranges one after the other on one core)"
    )
    for n, row in enumerate(rows):
        print(
            "  ".join(
                cell.ljust(w) if c == 0 else cell.rjust(w)
                for c, (cell, w) in enumerate(zip(row, widths, strict=True))
            )
        )
        if n == 0:
            print("  ".join("-" * w for w in widths))
    loads = [run[2] for xs in runs.values() for run in xs]
    print(
        f"load average (1 min) at the runs' starts: {min(loads):.1f}–{max(loads):.1f} "
        f"on {os.cpu_count()} CPUs; medians and bests over {len(loads) // len(runs)} rounds"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--records", type=int, default=1_000_000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument(
        "--no-single-partition", action="store_true", help="only the 4-partition comparison"
    )
    parser.add_argument("--no-spark", action="store_true", help="only the 1-partition rows")
    args = parser.parse_args()
    with kafka_settings(Path(tempfile.mkdtemp(prefix="bench-kafka-")), REPO / ".local") as settings:
        if not args.no_single_partition:
            single_partition(settings.kafka_bootstrap_servers, args.records, args.repeat)
        if not args.no_spark:
            four_partitions(settings, args.records, args.repeat)


if __name__ == "__main__":
    main()
