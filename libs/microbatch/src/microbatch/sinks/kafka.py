"""Exactly-once Kafka output from micro-batches: staged messages, one transaction per batch.

Why not produce from the tasks? A task may run twice (Spark retries, a rerun after a
crash), and nothing on the broker remembers that a batch was already written. So:

1. **Stage** (before the checkpoint commits): each instance writes its messages as one
   Arrow file in the pipeline's checkpoint store, at a deterministic key per batch,
   sink and instance (a rerun rewrites the same bytes).
2. **Publish** (after the commit, on the driver): one producer with the fixed
   ``transactional.id`` ``microbatch.<pipeline>.<sink>.<topic>`` (the topic in it, so two
   pipelines of one name writing to different topics — test or demo namespaces — never
   fence each other). ``init_transactions`` fences any earlier producer of the pipeline's
   sink (a crashed run, a stalled zombie) and waits for its transaction to complete or
   abort; a fenced zombie's commit then fails (:class:`~microbatch.errors.LeaseError`).
   Then it reads the *publish marker* — the committed offset of consumer group
   ``microbatch.<pipeline>.<sink>.published`` on partition 0 of the output topic, which
   holds ``last published batch + 1`` (stable: ``init_transactions`` has just finished
   the only transactions that move it). If the batch is already
   there, nothing is sent. Otherwise the staged messages and the new marker go in **one
   transaction** (``send_offsets_to_transaction``): a ``read_committed`` consumer sees the
   batch's messages exactly once, whatever crashes around it.

A batch with no messages for the sink opens no producer and no transaction (the marker
then names the last batch that had messages): there is nothing to double, and an idle
pipeline's batch saves the ~0.5 s of ``init_transactions`` and the marker round trip.
A crashed earlier transaction is still fenced, by the rerun of that batch's own publish,
which comes before any later batch.

The marker group is bookkeeping, not a reader: lag tools show it with a meaningless lag.
"""

from __future__ import annotations

import dataclasses
import io
import json
import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, TypeVar

import pyarrow as pa
import pyarrow.ipc as ipc

from microbatch.datasets import DatasetRef, kafka_dataset
from microbatch.errors import LeaseError, SinkError
from microbatch.settings import Settings
from microbatch.sinks.base import PublishContext, Sink, StageContext, Staged
from microbatch.storage import ObjectStore
from microbatch.validation import check_name

log = logging.getLogger(__name__)
T = TypeVar("T")

MESSAGE_SCHEMA = pa.schema(
    [
        ("key", pa.binary()),
        ("value", pa.binary()),
        ("headers", pa.list_(pa.struct([("key", pa.string()), ("value", pa.binary())]))),
    ]
)


@dataclasses.dataclass(frozen=True)
class KafkaSink(Sink):
    """JSON records to ``topic``, exactly once for ``read_committed`` consumers.

    ``key_field`` picks the message key (None: no key). Values are UTF-8 JSON with sorted
    keys, so reruns produce identical bytes. Kafka records cannot be taken back: a rewind
    publishes the undone batches' records again (only with ``accept_kafka_repeats``).
    """

    name: str
    topic: str
    key_field: str | None = None

    retractable = False

    def __post_init__(self) -> None:
        check_name("sink", self.name)
        check_name("topic", self.topic)

    def encode(self, rows: Sequence[Any]) -> pa.Table:
        return json_messages(rows, self.key_field)

    def stage(self, ctx: StageContext, rows: Sequence[Any]) -> Staged | None:
        return self.stage_table(ctx, self.encode(rows))

    def stage_table(self, ctx: StageContext, table: pa.Table) -> Staged | None:
        key = ctx.layout.staging_key(ctx.batch_id, self.name, ctx.instance, ctx.attempt)
        return stage_messages(ctx.checkpoint_store, key, table)

    def publish(self, ctx: PublishContext) -> None:
        publish_messages(
            ctx.settings.kafka_bootstrap_servers,
            ctx.pipeline,
            self.name,
            self.topic,
            ctx.batch_id,
            load_messages(ctx.checkpoint_store, ctx.staged),
            ctx.settings.kafka_client_config(),
        )

    def dataset(self, settings: Settings) -> DatasetRef:
        return kafka_dataset(settings.kafka_bootstrap_servers, self.topic)

    def last_published(self, settings: Settings, pipeline: str) -> int | None:
        return last_published(
            settings.kafka_bootstrap_servers,
            pipeline,
            self.name,
            self.topic,
            settings.kafka_client_config(),
        )


def json_messages(records: Iterable[Any], key_field: str | None) -> pa.Table:
    """Records as JSON messages with sorted keys (same record → same bytes)."""
    keys, values = [], []
    for r in records:
        values.append(json.dumps(r, sort_keys=True, separators=(",", ":"), default=str).encode())
        k = r.get(key_field) if key_field and isinstance(r, dict) else None
        keys.append(None if k is None else str(k).encode())
    return pa.table(
        {"key": keys, "value": values, "headers": [[] for _ in values]}, schema=MESSAGE_SCHEMA
    )


def stage_messages(store: ObjectStore, key: str, table: pa.Table) -> Staged | None:
    """One instance's messages as an Arrow file at ``key`` of the checkpoint store."""
    if table.num_rows == 0:
        return None
    buf = io.BytesIO()
    with ipc.new_file(buf, MESSAGE_SCHEMA) as writer:
        writer.write_table(table.cast(MESSAGE_SCHEMA))
    store.put(key, buf.getvalue())
    return Staged(key, table.num_rows)


def load_messages(store: ObjectStore, staged: Sequence[Staged]) -> pa.Table:
    tables = [ipc.open_file(io.BytesIO(store.get(s.file))).read_all() for s in staged]
    return pa.concat_tables(tables) if tables else MESSAGE_SCHEMA.empty_table()


def transactional_id(pipeline: str, sink_name: str, topic: str) -> str:
    return f"microbatch.{pipeline}.{sink_name}.{topic}"


def marker_group(pipeline: str, sink_name: str) -> str:
    return f"microbatch.{pipeline}.{sink_name}.published"


def _retrying(what: str, fn: Callable[[], T], timeout_s: float = 60.0) -> T:
    """Retry Kafka's retriable errors (e.g. the group coordinator of a fresh cluster is
    not available yet) with a capped backoff; anything else, or the timeout, raises."""
    deadline, delay = time.monotonic() + timeout_s, 0.1
    while True:
        try:
            return fn()
        except Exception as e:
            if not getattr(e, "retriable", False) or time.monotonic() + delay > deadline:
                raise
            log.info("%s: %r, retrying in %.1fs", what, e, delay)
            time.sleep(delay)
            delay = min(delay * 2, 2.0)


def last_published(
    bootstrap_servers: str,
    pipeline: str,
    sink_name: str,
    topic: str,
    client_config: Mapping[str, Any] | None = None,
) -> int | None:
    """The last batch id published to ``topic`` by this sink, None if none yet."""
    from kafka import KafkaAdminClient
    from kafka import TopicPartition as KafkaTopicPartition

    admin = KafkaAdminClient(
        bootstrap_servers=bootstrap_servers, request_timeout_ms=30_000, **(client_config or {})
    )
    try:
        group = marker_group(pipeline, sink_name)
        tp = KafkaTopicPartition(topic, 0)
        offsets = _retrying(
            f"reading publish marker of group {group!r}",
            lambda: admin.list_group_offsets({group: [tp]}).get(group, {}),
        )
    finally:
        admin.close()
    found = offsets.get(tp)
    if found is None or found.offset is None or found.offset < 0:
        return None
    return found.offset - 1


def publish_messages(
    bootstrap_servers: str,
    pipeline: str,
    sink_name: str,
    topic: str,
    batch_id: int,
    messages: pa.Table,
    client_config: Mapping[str, Any] | None = None,
) -> bool:
    """Publish a batch's messages once; False when the batch was already published or
    had no messages (nothing sent, no transaction). ``client_config``: how to connect
    (``Settings.kafka_client_config``)."""
    if messages.num_rows == 0:
        return False
    from kafka import KafkaProducer  # the client loads when a batch publishes, not before
    from kafka import TopicPartition as KafkaTopicPartition
    from kafka.structs import OffsetAndMetadata

    where = f"pipeline {pipeline!r} sink {sink_name!r} (topic {topic!r}, {bootstrap_servers})"
    try:
        producer = KafkaProducer(
            bootstrap_servers=bootstrap_servers,
            transactional_id=transactional_id(pipeline, sink_name, topic),
            enable_idempotence=True,
            acks="all",
            linger_ms=5,
            **(client_config or {}),
        )
    except Exception as e:
        raise SinkError(
            f"{where}: cannot create the transactional producer: {e}. The checkpoint is "
            "committed; rerun the pipeline once the broker is reachable to publish it (once)."
        ) from e
    try:
        # Fences zombies; completes or aborts their open transaction.
        _retrying(f"{where}: init_transactions", producer.init_transactions)
        done = last_published(bootstrap_servers, pipeline, sink_name, topic, client_config)
        if done is not None and done >= batch_id:
            log.info("%s: batch %s already published (marker %s)", where, batch_id, done)
            return False
        if done is not None and done != batch_id - 1:  # batches in between had no messages
            log.debug("%s: publishing batch %s after batch %s", where, batch_id, done)
        producer.begin_transaction()
        cols = messages.to_pydict()
        for key, value, headers in zip(cols["key"], cols["value"], cols["headers"], strict=True):
            hdrs = [(h["key"], h["value"]) for h in headers or ()]
            producer.send(topic, key=key, value=value, headers=hdrs or None)
        marker = {KafkaTopicPartition(topic, 0): OffsetAndMetadata(batch_id + 1, "", -1)}
        _retrying(
            f"{where}: adding the publish marker to the transaction",
            lambda: producer.send_offsets_to_transaction(marker, marker_group(pipeline, sink_name)),
        )
        producer.flush()  # every message on the broker, inside the open transaction
        from microbatch.runtime.faults import pause_if  # the kill-and-race tests' hook

        pause_if("in_kafka_transaction", where)
        producer.commit_transaction()
        return True
    except SinkError:
        raise
    except Exception as e:
        from kafka.errors import InvalidProducerEpochError, ProducerFencedError

        if isinstance(e, ProducerFencedError | InvalidProducerEpochError):
            raise LeaseError(
                f"{where}: batch {batch_id}'s transaction was fenced: another producer of "
                "this sink started (a newer run that took over the pipeline, or a stalled "
                "older attempt publishing late), and the broker aborted this one. Nothing was "
                "committed twice: the batch's checkpoint is committed, and the next run "
                "publishes it exactly once. Nothing to do but let it run."
            ) from e
        raise SinkError(
            f"{where}: publishing batch {batch_id} failed: {e!r}. The checkpoint is "
            "committed; rerun the pipeline to publish it (the transaction guarantees once)."
        ) from e
    finally:
        producer.close(timeout=10)
