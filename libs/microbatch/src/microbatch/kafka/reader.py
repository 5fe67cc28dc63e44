"""Read planned offset ranges: one partition range in Python, many ranges in Spark.

:func:`read_range` returns exactly the committed records whose offsets are in
``[start, end)``. Offsets may have gaps — compaction removed records, transaction markers
take an offset each, and ``read_committed`` hides aborted records — so the loop never
waits for a particular offset: it stops once the consumer's *position* reaches ``end``,
which also moves past markers and aborted batches at the tail of a range. It does not
reset a missing offset (``auto_offset_reset='none'``): a range whose start retention
already deleted is an error, never a silent jump.

:func:`read_ranges` runs :func:`read_range` inside Spark tasks with ``mapInArrow`` (no
RDDs, so it works on Spark Connect too), one range per Spark partition.
"""

from __future__ import annotations

import logging
import operator
import time
from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from microbatch.errors import ConfigError, DataLossError, SourceError
from microbatch.gcpause import paused_while_producing
from microbatch.kafka.offsets import OffsetRange

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

log = logging.getLogger(__name__)

HEADER_TYPE = pa.struct([("key", pa.string()), ("value", pa.binary())])
KAFKA_SCHEMA = pa.schema(
    [
        ("key", pa.binary()),
        ("value", pa.binary()),
        ("topic", pa.string()),
        ("partition", pa.int32()),
        ("offset", pa.int64()),
        ("timestamp", pa.int64()),  # epoch milliseconds, as the broker stored it
        ("headers", pa.list_(HEADER_TYPE)),
    ]
)
#: What ``source_only=True`` readers fill (stage 1 reads no more); ``timestamp`` and
#: ``headers`` stay null: taking them from every message cost ~6 % of a Nexmark query's
#: Python CPU (confluent-kafka parses a message's headers when asked).
SOURCE_ONLY = ("key", "value", "topic", "partition", "offset")
#: The same schema as a Spark DDL string, for ``mapInArrow``.
KAFKA_SPARK_SCHEMA = (
    "key binary, value binary, topic string, partition int, offset bigint, "
    "timestamp bigint, headers array<struct<key: string, value: binary>>"
)

#: Consumer settings that decide *which* records are returned; callers may not change them.
_FIXED_CONFIG: dict[str, Any] = {
    "enable_auto_commit": False,
    "isolation_level": "read_committed",
    "auto_offset_reset": "none",
    "group_id": None,
    "check_crcs": True,
}
#: Throughput defaults (bigger fetches mean fewer round trips; a short metadata back-off
#: saves ~100 ms per range, which adds up over many small ranges); callers may override.
_DEFAULT_CONFIG: dict[str, Any] = {
    "retry_backoff_ms": 20,
    "max_partition_fetch_bytes": 16 * 1024 * 1024,
    "fetch_max_bytes": 64 * 1024 * 1024,
    "fetch_min_bytes": 1,
    "fetch_max_wait_ms": 100,
    "receive_buffer_bytes": 4 * 1024 * 1024,
}


def build_consumer_config(
    bootstrap_servers: str, overrides: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """The kafka-python settings :func:`read_range` uses, with ``overrides`` merged in."""
    overrides = dict(overrides or {})
    fixed = sorted(k for k in overrides if k in _FIXED_CONFIG and overrides[k] != _FIXED_CONFIG[k])
    if fixed:
        raise ConfigError(
            f"consumer_config may not change {fixed}: they decide which records a range "
            f"contains (fixed: {_FIXED_CONFIG})"
        )
    return {"bootstrap_servers": bootstrap_servers, **_DEFAULT_CONFIG, **overrides, **_FIXED_CONFIG}


_KEY = operator.attrgetter("key")
_VALUE = operator.attrgetter("value")
_OFFSET = operator.attrgetter("offset")
_TIMESTAMP = operator.attrgetter("timestamp")
_HEADERS = operator.attrgetter("headers")
_HEADERS_TYPE = KAFKA_SCHEMA.field("headers").type


def _headers_array(all_headers: list[Any]) -> pa.Array:
    """``list<struct<key, value>>`` from per-record header lists, via flat child arrays."""
    n = len(all_headers)
    if not any(all_headers):  # the common case: no headers anywhere in the batch
        empty = pa.StructArray.from_arrays(
            [pa.array([], pa.string()), pa.array([], pa.binary())], fields=list(HEADER_TYPE)
        )
        return pa.ListArray.from_arrays(
            pa.array([0] * (n + 1), pa.int32()), empty, type=_HEADERS_TYPE
        )
    offsets = [0]
    keys: list[str] = []
    values: list[bytes | None] = []
    for headers in all_headers:
        for k, v in headers:
            keys.append(k)
            values.append(v)
        offsets.append(len(keys))
    children = pa.StructArray.from_arrays(
        [pa.array(keys, pa.string()), pa.array(values, pa.binary())], fields=list(HEADER_TYPE)
    )
    return pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), children, type=_HEADERS_TYPE)


def _to_batch(
    topic: str, partition: int, records: list[Any], source_only: bool = False
) -> pa.RecordBatch:
    """One Arrow batch from kafka-python ``ConsumerRecord``s: whole columns at once."""
    return kafka_batch(
        topic,
        partition,
        list(map(_KEY, records)),
        list(map(_VALUE, records)),
        list(map(_OFFSET, records)),
        None if source_only else list(map(_TIMESTAMP, records)),
        None if source_only else list(map(_HEADERS, records)),
    )


def kafka_batch(
    topic: str,
    partition: int,
    keys: list[bytes | None],
    values: list[bytes | None],
    offsets: list[int],
    timestamps: list[int] | None,
    headers: list[Any] | None,
) -> pa.RecordBatch:
    """One :data:`KAFKA_SCHEMA` batch of one partition's records, given column by column
    (whichever client read them); ``timestamps``/``headers`` None: those columns null
    (a reader asked for :data:`SOURCE_ONLY` columns)."""
    n = len(offsets)
    return pa.RecordBatch.from_arrays(
        [
            pa.array(keys, pa.binary()),
            pa.array(values, pa.binary()),
            pa.repeat(pa.scalar(topic, pa.string()), n),  # a tenth of a list's cost
            pa.repeat(pa.scalar(partition, pa.int32()), n),
            pa.array(offsets, pa.int64()),
            pa.nulls(n, pa.int64()) if timestamps is None else pa.array(timestamps, pa.int64()),
            pa.nulls(n, _HEADERS_TYPE) if headers is None else _headers_array(headers),
        ],
        schema=KAFKA_SCHEMA,
    )


def deleted_start(where: str, offset: int) -> DataLossError:
    """The error of a range whose next offset retention deleted after planning (either
    reader), saying how to go on."""
    return DataLossError(
        f"reading {where}: offset {offset} is no longer available (retention deleted it "
        "after the batch was planned). Rerun with `microbatch run --replan` (or "
        "on_out_of_range='earliest') to plan the batch again without the deleted records, "
        "which its stats then count as skipped."
    )


def read_range(
    bootstrap_servers: str,
    r: OffsetRange,
    *,
    batch_rows: int = 10_000,
    poll_timeout_s: float = 60.0,
    consumer_config: Mapping[str, Any] | None = None,
    source_only: bool = False,
) -> Iterator[pa.RecordBatch]:
    """Yield the committed records of ``r`` as Arrow batches of up to ``batch_rows`` rows
    (``source_only``: the :data:`SOURCE_ONLY` columns filled, the others null).

    Fails with :class:`SourceError` if the consumer makes no progress for
    ``poll_timeout_s`` seconds (a broker down, or a range past the end of the log) or
    if ``r.start`` is no longer available.
    """
    from kafka import KafkaConsumer
    from kafka import TopicPartition as KafkaTopicPartition
    from kafka.errors import OffsetOutOfRangeError

    if batch_rows < 1:
        raise SourceError(f"{r.tp}: batch_rows must be ≥ 1, got {batch_rows}")
    if r.count == 0:
        return
    config = build_consumer_config(bootstrap_servers, consumer_config)
    config.setdefault("max_poll_records", batch_rows)
    where = f"{r.tp} [{r.start}, {r.end}) on {bootstrap_servers}"
    try:
        consumer = KafkaConsumer(**config)
    except Exception as exc:
        raise SourceError(f"reading {where}: cannot create a Kafka consumer: {exc!r}") from exc
    tp = KafkaTopicPartition(r.topic, r.partition)
    pending: list[Any] = []
    try:
        consumer.assign([tp])
        consumer.seek(tp, r.start)
        position = r.start
        last_progress = time.monotonic()
        while position < r.end:
            try:  # never more than one batch pending: no list copies, bounded memory
                polled = consumer.poll(timeout_ms=500, max_records=batch_rows - len(pending))
            except OffsetOutOfRangeError as exc:
                raise deleted_start(where, position) from exc
            records = polled.get(tp, ())
            if records and records[-1].offset >= r.end:
                records = [rec for rec in records if rec.offset < r.end]
            if records:
                pending.extend(records)
                if len(pending) >= batch_rows:
                    batch, pending = _to_batch(r.topic, r.partition, pending, source_only), []
                    yield batch  # the records freed first: see microbatch.gcpause
            new_position = consumer.position(tp)
            if new_position > position:
                position = new_position
                last_progress = time.monotonic()
            elif time.monotonic() - last_progress > poll_timeout_s:
                raise SourceError(
                    f"reading {where}: no progress for {poll_timeout_s:.0f} s at offset "
                    f"{position} (wanted up to {r.end}). Is the broker reachable, and was "
                    "the range planned against this cluster's end offsets?"
                )
        if pending:
            yield _to_batch(r.topic, r.partition, pending, source_only)
    finally:
        consumer.close(autocommit=False)


def split_ranges(
    ranges: Iterable[OffsetRange], max_records_per_task: int | None = None
) -> list[OffsetRange]:
    """Non-empty ``ranges``, sorted, each split into pieces of ≤ ``max_records_per_task``."""
    out: list[OffsetRange] = []
    for r in sorted(ranges):
        if r.count == 0:
            continue
        out += [r] if max_records_per_task is None else r.split(max_records_per_task)
    return out


def range_descriptors(
    spark: SparkSession, ranges: Iterable[OffsetRange], max_records_per_task: int | None = None
) -> DataFrame | None:
    """One row ``(topic, partition, start, end)`` per Spark partition, or None if empty.

    Built from ``spark.range`` with as many slices as rows, so no shuffle and no adaptive
    coalescing can merge two ranges into one task."""
    from pyspark.sql import functions as F

    pieces = split_ranges(ranges, max_records_per_task)
    if not pieces:
        return None
    rows = [
        F.struct(
            F.lit(p.topic).alias("topic"),
            F.lit(p.partition).alias("partition"),
            F.lit(p.start).cast("bigint").alias("start"),
            F.lit(p.end).cast("bigint").alias("end"),
        )
        for p in pieces
    ]
    return literal_rows(spark, rows, len(pieces))


def literal_rows(spark: SparkSession, rows: list[Any], slices: int) -> DataFrame:
    """A DataFrame of the struct columns ``rows``, in order, as ``slices`` Spark partitions
    of ``len(rows) / slices`` consecutive rows each: ``spark.range`` over the row numbers,
    each number replaced by its row, so no shuffle and no adaptive coalescing can move a
    row to another partition."""
    from pyspark.sql import functions as F

    table = F.array(*rows)
    return (
        spark.range(0, len(rows), 1, slices)
        .select(F.element_at(table, (F.col("id") + 1).cast("int")).alias("r"))
        .select("r.*")
    )


def read_descriptors(
    batches: Iterable[pa.RecordBatch],
    bootstrap_servers: str,
    *,
    client: str = "python",
    batch_rows: int = 10_000,
    poll_timeout_s: float = 60.0,
    consumer_config: Mapping[str, Any] | None = None,
    source_only: bool = False,
) -> Iterator[pa.RecordBatch]:
    """The records (``KAFKA_SCHEMA``) of the ranges described by ``range_descriptors`` rows:
    the body of a ``mapInArrow`` — alone, or fused with the next step of a task. ``client``:
    ``"python"`` reads with kafka-python (:func:`read_range`), ``"confluent"`` with
    confluent-kafka (``confluent_reader.read_range_confluent``), ``"native"`` with
    microbatch's native reader (``native_reader.read_range_native``); the same records.
    ``source_only``: only the :data:`SOURCE_ONLY` columns filled."""
    read = read_range
    if client == "confluent":
        from microbatch.kafka.confluent_reader import read_range_confluent as read
    elif client == "native":
        from microbatch.kafka.native_reader import read_range_native as read
    elif client != "python":
        raise ValueError(f"client must be 'python', 'confluent' or 'native', got {client!r}")
    for batch in batches:
        for row in batch.to_pylist():
            piece = OffsetRange(row["topic"], row["partition"], row["start"], row["end"])
            # The collector paused while a range is read: each batch holds tens of
            # thousands of fresh (acyclic) message objects (:mod:`microbatch.gcpause`).
            yield from paused_while_producing(
                read(
                    bootstrap_servers,
                    piece,
                    batch_rows=batch_rows,
                    poll_timeout_s=poll_timeout_s,
                    consumer_config=consumer_config,
                    source_only=source_only,
                )
            )


def read_ranges(
    spark: SparkSession,
    bootstrap_servers: str,
    ranges: Iterable[OffsetRange],
    *,
    max_records_per_task: int | None = None,
    batch_rows: int = 10_000,
    poll_timeout_s: float = 60.0,
    consumer_config: Mapping[str, Any] | None = None,
) -> DataFrame:
    """A DataFrame (``KAFKA_SCHEMA``) of the records of ``ranges``, one range per task."""
    config = dict(consumer_config or {})
    build_consumer_config(bootstrap_servers, config)  # bad settings fail on the driver
    descriptors = range_descriptors(spark, ranges, max_records_per_task)
    if descriptors is None:
        return spark.createDataFrame([], KAFKA_SPARK_SCHEMA)

    def read(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        return read_descriptors(
            batches,
            bootstrap_servers,
            batch_rows=batch_rows,
            poll_timeout_s=poll_timeout_s,
            consumer_config=config,
        )

    return descriptors.mapInArrow(read, KAFKA_SPARK_SCHEMA)
