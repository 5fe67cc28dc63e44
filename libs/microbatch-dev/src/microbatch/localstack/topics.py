"""Kafka topics for development: create them, fill them, read back what was committed.

Plain kafka-python clients of the broker at ``bootstrap`` (the local stack's, or any
unsecured one), shared by the demo, ``make airflow``, the tests and the benches. The
pipeline's own Kafka clients live in :mod:`microbatch.kafka` and :mod:`microbatch.sinks`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


def create_topics(bootstrap: str, topics: Mapping[str, int]) -> None:
    """Create each topic with its number of partitions (replication factor 1)."""
    from kafka import KafkaAdminClient

    admin = KafkaAdminClient(bootstrap_servers=bootstrap)
    try:
        admin.create_topics(
            {t: {"num_partitions": n, "replication_factor": 1} for t, n in topics.items()},
            wait_for_metadata=True,
        )
    finally:
        admin.close()


def produce(bootstrap: str, topic: str, values: Sequence[tuple[bytes | None, bytes]]) -> None:
    """Send ``(key, value)`` records to ``topic`` and wait until every one is acknowledged."""
    from kafka import KafkaProducer

    producer = KafkaProducer(bootstrap_servers=bootstrap, acks="all", linger_ms=20)
    try:
        for key, value in values:
            producer.send(topic, key=key, value=value)
        producer.flush()
    finally:
        producer.close()


def read_topic(bootstrap: str, topic: str) -> list[Any]:
    """Every message of ``topic`` as a ``read_committed`` consumer sees it."""
    from kafka import KafkaConsumer, TopicPartition

    consumer = KafkaConsumer(
        bootstrap_servers=bootstrap, isolation_level="read_committed", enable_auto_commit=False
    )
    try:
        tps = [TopicPartition(topic, p) for p in sorted(consumer.partitions_for_topic(topic))]
        consumer.assign(tps)
        consumer.seek_to_beginning(*tps)
        end = consumer.end_offsets(tps)
        out: list[Any] = []
        while any(consumer.position(tp) < end[tp] for tp in tps):
            for records in consumer.poll(timeout_ms=1000).values():
                out += records
        return out
    finally:
        consumer.close()
