"""Kafka range reader: records/s of ``read_range`` vs a raw kafka-python consumer loop.

Produces ``--records`` records of ~200 bytes into a fresh single-partition topic, then, in
the same run and on one core each (no Spark):

- a raw kafka-python loop: ``assign`` + ``seek_to_beginning`` + ``poll`` until the end,
  counting records — once with kafka-python's default fetch settings and once with the
  reader's fetch settings (the fair reference: same bytes per round trip);
- :func:`microbatch.kafka.read_range` over the same offsets, building Arrow batches.

Target: ``read_range`` ≥ 0.8 × the raw loop with the same fetch settings. Each reader runs
``--repeat`` times, alternating with the others; the best run of each counts, and the
median ratio of paired runs is shown too (a shared machine's load varies).

Uses the broker at ``MICROBATCH_KAFKA_BOOTSTRAP_SERVERS`` if set (e.g. ``make stack``),
else starts a Kafka broker on free loopback ports and stops it at the end.

    .venv/bin/python bench/bench_kafka_reader.py [--records 1000000] [--repeat 2]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from microbatch.kafka import OffsetRange, read_range
from microbatch.kafka.reader import build_consumer_config
from microbatch.localstack import KafkaBroker
from microbatch.localstack.process import free_port_block
from microbatch.settings import Settings

REPO = Path(__file__).resolve().parents[1]
VALUE_BYTES = 180  # + a 12-byte key + record overhead ≈ 200 bytes per record


def produce(bootstrap: str, topic: str, n: int) -> float:
    from kafka import KafkaAdminClient, KafkaProducer

    admin = KafkaAdminClient(bootstrap_servers=bootstrap)
    try:
        spec = {"num_partitions": 1, "replication_factor": 1}
        admin.create_topics({topic: spec}, wait_for_metadata=True)
    finally:
        admin.close()
    producer = KafkaProducer(
        bootstrap_servers=bootstrap,
        acks=1,
        linger_ms=20,
        batch_size=512 * 1024,
        max_request_size=8 * 1024 * 1024,
    )
    payload = os.urandom(VALUE_BYTES // 2).hex().encode()
    t = time.monotonic()
    try:
        for i in range(n):
            producer.send(topic, key=b"key-%08d" % (i % 100_000), value=payload, partition=0)
        producer.flush()
    finally:
        producer.close()
    return time.monotonic() - t


def raw_loop(bootstrap: str, topic: str, end: int, config: dict) -> int:
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
    assert size == n * VALUE_BYTES
    return n


def microbatch_reader(bootstrap: str, topic: str, end: int) -> int:
    n = 0
    for batch in read_range(bootstrap, OffsetRange(topic, 0, 0, end)):
        n += batch.num_rows
    return n


def timed(fn: Callable[[], int], expected: int) -> float:
    t = time.monotonic()
    n = fn()
    elapsed = time.monotonic() - t
    if n != expected:
        raise SystemExit(f"read {n:,} records, expected {expected:,}")
    return n / elapsed


def run(bootstrap: str, records: int, repeat: int) -> None:
    from kafka import KafkaConsumer, TopicPartition

    topic = f"bench-reader-{uuid.uuid4().hex[:8]}"
    print(f"producing {records:,} records of ~200 bytes to {topic} on {bootstrap} ...")
    seconds = produce(bootstrap, topic, records)
    print(f"  produced in {seconds:.1f} s ({records / seconds:,.0f}/s)")
    probe = KafkaConsumer(bootstrap_servers=bootstrap, isolation_level="read_committed")
    try:
        end = probe.end_offsets([TopicPartition(topic, 0)])[TopicPartition(topic, 0)]
    finally:
        probe.close()

    base = {
        "bootstrap_servers": bootstrap,
        "enable_auto_commit": False,
        "isolation_level": "read_committed",
        "auto_offset_reset": "earliest",
    }
    tuned = {**build_consumer_config(bootstrap), "auto_offset_reset": "earliest"}
    readers: dict[str, Callable[[], int]] = {
        "raw loop, default fetch settings": lambda: raw_loop(bootstrap, topic, end, base),
        "raw loop, reader fetch settings": lambda: raw_loop(bootstrap, topic, end, tuned),
        "read_range → Arrow batches": lambda: microbatch_reader(bootstrap, topic, end),
    }
    rates: dict[str, list[float]] = {label: [] for label in readers}
    print("reading (one process, one core; runs alternate so load swings hit all alike):")
    for i in range(repeat):
        for label, fn in readers.items():
            rates[label].append(timed(fn, records))
            print(f"  run {i + 1}  {label:<34} {rates[label][-1]:>10,.0f} records/s")
    raw_default, raw_tuned, ours = (max(r) for r in rates.values())
    paired = sorted(
        o / r for o, r in zip(rates["read_range → Arrow batches"],
                              rates["raw loop, reader fetch settings"], strict=True)
    )  # fmt: skip

    rows = [
        ("raw kafka-python loop (defaults)", f"{raw_default:,.0f}/s", ""),
        ("raw kafka-python loop (same fetch)", f"{raw_tuned:,.0f}/s", "reference"),
        ("read_range (Arrow)", f"{ours:,.0f}/s", ""),
        ("read_range / raw (same fetch), best", f"{ours / raw_tuned:.2f}", "target ≥ 0.8"),
        ("  same, median of paired runs", f"{paired[len(paired) // 2]:.2f}", ""),
        ("read_range / raw (defaults)", f"{ours / raw_default:.2f}", "informational"),
    ]
    w0 = max(len(r[0]) for r in rows)
    w1 = max(len(r[1]) for r in rows)
    print(f"\n{'metric':<{w0}}  {'value':>{w1}}  notes")
    print(f"{'-' * w0}  {'-' * w1}  {'-' * 14}")
    for name, value, note in rows:
        print(f"{name:<{w0}}  {value:>{w1}}  {note}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--records", type=int, default=1_000_000)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    if "MICROBATCH_KAFKA_BOOTSTRAP_SERVERS" in os.environ:
        run(Settings.from_env().kafka_bootstrap_servers, args.records, args.repeat)
        return
    port = free_port_block([0, 1])
    settings = Settings.from_env(
        kafka_bootstrap_servers=f"127.0.0.1:{port}", home=str(REPO / ".local")
    )
    broker = KafkaBroker(settings, Path(tempfile.mkdtemp(prefix="bench-kafka-")) / "kafka")
    print(f"starting Kafka at {settings.kafka_bootstrap_servers} ...")
    broker.start()
    try:
        run(settings.kafka_bootstrap_servers, args.records, args.repeat)
    finally:
        broker.stop()


if __name__ == "__main__":
    main()
