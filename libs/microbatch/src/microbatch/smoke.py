"""End-to-end smoke job of the foundation: Kafka → Spark (mapInArrow) → Parquet on S3.

It proves the stack is real before any pipeline exists: JSON events are produced to a
topic, every partition's offset range is read inside Spark tasks with kafka-python, and
each range is written as one Parquet file to the bucket at a deterministic path
(``smoke/<run>/part-<topic>-<partition>.parquet``), so a rerun rewrites the same files.
The real pipeline (later issues) replaces this as ``make demo``'s job.
"""

from __future__ import annotations

import json
import logging
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pyarrow as pa

from microbatch.errors import SourceError
from microbatch.settings import Settings

log = logging.getLogger(__name__)

EVENT_SCHEMA = pa.schema(
    [
        ("user_id", pa.string()),
        ("page", pa.string()),
        ("ts", pa.int64()),
        ("partition", pa.int32()),
        ("offset", pa.int64()),
    ]
)
RESULT_SCHEMA = "partition int, records long, path string, bytes long"
RESULT_ARROW_SCHEMA = pa.schema(
    [
        ("partition", pa.int32()),
        ("records", pa.int64()),
        ("path", pa.string()),
        ("bytes", pa.int64()),
    ]
)
PAGES = ["/", "/search", "/product", "/cart", "/checkout", "/help"]


@dataclass(frozen=True)
class SmokeResult:
    topic: str
    produced: int
    partitions: int
    records_read: int
    files: list[str]
    rows_in_parquet: int
    produce_seconds: float
    spark_seconds: float


def ensure_topic(settings: Settings, topic: str, partitions: int) -> None:
    from kafka import KafkaAdminClient
    from kafka.admin import NewTopic
    from kafka.errors import TopicAlreadyExistsError

    admin = KafkaAdminClient(
        bootstrap_servers=settings.kafka_bootstrap_servers, **settings.kafka_client_config()
    )
    try:
        admin.create_topics([NewTopic(topic, partitions, 1)])
    except TopicAlreadyExistsError:
        pass
    finally:
        admin.close()


def produce_events(settings: Settings, topic: str, count: int, seed: int = 7) -> int:
    """Produce ``count`` JSON click events keyed by user; returns the number acknowledged."""
    from kafka import KafkaProducer

    rng = random.Random(seed)
    producer = KafkaProducer(
        bootstrap_servers=settings.kafka_bootstrap_servers,
        linger_ms=20,
        acks="all",
        **settings.kafka_client_config(),
    )
    start_ms = 1_767_225_600_000  # 2026-01-01T00:00:00Z
    futures = []
    for i in range(count):
        user = f"user-{rng.randrange(500):04d}"
        event = {"user_id": user, "page": rng.choice(PAGES), "ts": start_ms + i * 250}
        futures.append(producer.send(topic, key=user.encode(), value=json.dumps(event).encode()))
    producer.flush()
    producer.close()
    return sum(1 for f in futures if f.succeeded())


def partition_ranges(settings: Settings, topic: str) -> list[tuple[int, int, int]]:
    """(partition, from, until) for every partition of ``topic``, from earliest to end."""
    from kafka import KafkaConsumer, TopicPartition

    consumer = KafkaConsumer(
        bootstrap_servers=settings.kafka_bootstrap_servers, **settings.kafka_client_config()
    )
    try:
        parts = consumer.partitions_for_topic(topic)
        if not parts:
            raise SourceError(
                f"topic {topic!r} not found on {settings.kafka_bootstrap_servers}: create it first"
            )
        tps = [TopicPartition(topic, p) for p in sorted(parts)]
        begin = consumer.beginning_offsets(tps)
        end = consumer.end_offsets(tps)
    finally:
        consumer.close()
    return [(tp.partition, begin[tp], end[tp]) for tp in tps]


def read_range(settings: Settings, topic: str, partition: int, start: int, until: int) -> pa.Table:
    """Exactly the records of ``[start, until)`` of one partition, as an Arrow table."""
    from kafka import KafkaConsumer, TopicPartition

    tp = TopicPartition(topic, partition)
    consumer = KafkaConsumer(
        bootstrap_servers=settings.kafka_bootstrap_servers,
        enable_auto_commit=False,
        isolation_level="read_committed",
        **settings.kafka_client_config(),
    )
    cols: dict[str, list] = {name: [] for name in EVENT_SCHEMA.names}
    try:
        consumer.assign([tp])
        consumer.seek(tp, start)
        position = start
        deadline = time.monotonic() + 60
        while position < until:
            if time.monotonic() > deadline:
                raise SourceError(
                    f"{topic}[{partition}]: stuck at offset {position} of [{start}, {until})"
                )
            for record in consumer.poll(timeout_ms=1000).get(tp, []):
                if record.offset >= until:
                    break
                event = json.loads(record.value)
                cols["user_id"].append(event["user_id"])
                cols["page"].append(event["page"])
                cols["ts"].append(event["ts"])
                cols["partition"].append(partition)
                cols["offset"].append(record.offset)
            position = consumer.position(tp)
    finally:
        consumer.close()
    return pa.Table.from_pydict(cols, schema=EVENT_SCHEMA)


def _ranges_to_parquet(settings: Settings, topic: str, prefix: str):
    """A ``mapInArrow`` function: each input row is a range; each output row a written file."""

    def run(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        import pyarrow.fs as pafs
        import pyarrow.parquet as pq

        fs = pafs.S3FileSystem(**settings.pyarrow_s3_kwargs())
        for batch in batches:
            for row in batch.to_pylist():
                table = read_range(settings, topic, row["partition"], row["start"], row["until"])
                path = f"{settings.s3_bucket}/{prefix}/part-{topic}-{row['partition']}.parquet"
                pq.write_table(table, path, filesystem=fs)
                size = fs.get_file_info(path).size
                yield pa.RecordBatch.from_pylist(
                    [
                        {
                            "partition": row["partition"],
                            "records": table.num_rows,
                            "path": f"s3://{path}",
                            "bytes": size,
                        }
                    ],
                    schema=RESULT_ARROW_SCHEMA,
                )

    return run


def run_smoke(
    settings: Settings,
    *,
    topic: str = "smoke-events",
    events: int = 10_000,
    partitions: int = 3,
    run_id: str = "demo",
    produce: bool = True,
    spark=None,
) -> SmokeResult:
    """Produce (optionally), read every partition in Spark, write Parquet, verify."""
    import pyarrow.dataset as ds
    import pyarrow.fs as pafs

    from microbatch.spark import spark_session

    ensure_topic(settings, topic, partitions)
    t0 = time.monotonic()
    produced = produce_events(settings, topic, events) if produce else 0
    t1 = time.monotonic()
    ranges = partition_ranges(settings, topic)
    spark = spark or spark_session(settings, app_name=f"microbatch-smoke-{run_id}")
    prefix = f"smoke/{run_id}"
    plan = spark.createDataFrame(ranges, "partition int, start long, until long")
    written = (
        plan.repartition(len(ranges))
        .mapInArrow(_ranges_to_parquet(settings, topic, prefix), RESULT_SCHEMA)
        .collect()
    )
    t2 = time.monotonic()
    fs = pafs.S3FileSystem(**settings.pyarrow_s3_kwargs())
    rows = ds.dataset(
        f"{settings.s3_bucket}/{prefix}", filesystem=fs, format="parquet"
    ).count_rows()
    return SmokeResult(
        topic=topic,
        produced=produced,
        partitions=len(ranges),
        records_read=sum(r["records"] for r in written),
        files=sorted(r["path"] for r in written),
        rows_in_parquet=rows,
        produce_seconds=t1 - t0,
        spark_seconds=t2 - t1,
    )


def summary(result: SmokeResult) -> str:
    lines = [
        "microbatch smoke run",
        f"  topic            {result.topic} ({result.partitions} partitions)",
        f"  produced         {result.produced:,} events in {result.produce_seconds:.1f} s",
        f"  read by Spark    {result.records_read:,} records in {result.spark_seconds:.1f} s",
        f"  Parquet rows     {result.rows_in_parquet:,} in {len(result.files)} files",
    ]
    lines += [f"                   {path}" for path in result.files]
    return "\n".join(lines)
