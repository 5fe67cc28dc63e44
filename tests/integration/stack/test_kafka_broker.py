"""The embedded broker is real Apache Kafka: records round-trip, transactions are atomic."""

from __future__ import annotations

import time
import uuid

import pytest
from kafka import KafkaAdminClient, KafkaConsumer, KafkaProducer, TopicPartition
from kafka.admin import NewTopic

pytestmark = pytest.mark.integration


def _topic(settings, partitions: int = 2) -> str:
    name = f"t-{uuid.uuid4().hex[:8]}"
    admin = KafkaAdminClient(bootstrap_servers=settings.kafka_bootstrap_servers)
    admin.create_topics([NewTopic(name, partitions, 1)])
    admin.close()
    return name


def _drain(consumer: KafkaConsumer, want: int, seconds: float = 10.0) -> list:
    records: list = []
    deadline = time.monotonic() + seconds
    while len(records) < want and time.monotonic() < deadline:
        for batch in consumer.poll(timeout_ms=200).values():
            records.extend(batch)
    return records


@pytest.fixture
def consumers(kafka_settings):
    """Factory of read_committed consumers from the beginning; all closed after the test.

    An unclosed kafka-python client keeps a non-daemon thread reconnecting forever once
    the broker stops, which would hang the end of the test run.
    """
    opened: list[KafkaConsumer] = []

    def make(topic: str, partitions: int) -> KafkaConsumer:
        consumer = KafkaConsumer(
            bootstrap_servers=kafka_settings.kafka_bootstrap_servers,
            isolation_level="read_committed",
            enable_auto_commit=False,
        )
        opened.append(consumer)
        consumer.assign([TopicPartition(topic, p) for p in range(partitions)])
        consumer.seek_to_beginning()
        return consumer

    yield make
    for consumer in opened:
        consumer.close()


def test_produce_then_consume_returns_every_record_in_partition_order(kafka_settings, consumers):
    topic = _topic(kafka_settings)
    producer = KafkaProducer(bootstrap_servers=kafka_settings.kafka_bootstrap_servers)
    for i in range(100):
        producer.send(topic, value=f"{i}".encode(), partition=i % 2)
    producer.flush()
    producer.close()

    records = _drain(consumers(topic, 2), want=100)

    assert len(records) == 100
    for partition in (0, 1):
        values = [int(r.value) for r in records if r.partition == partition]
        assert values == sorted(values), f"partition {partition} out of order: {values}"
    assert sorted(int(r.value) for r in records) == list(range(100))


def test_transaction_is_invisible_to_read_committed_until_commit(kafka_settings, consumers):
    topic = _topic(kafka_settings)
    producer = KafkaProducer(
        bootstrap_servers=kafka_settings.kafka_bootstrap_servers,
        transactional_id=f"tx-{topic}",
    )
    producer.init_transactions()
    producer.begin_transaction()
    for i in range(10):
        producer.send(topic, value=f"committed-{i}".encode(), partition=i % 2)
    producer.flush()
    consumer = consumers(topic, 2)

    seen_before_commit = _drain(consumer, want=1, seconds=2.0)
    producer.commit_transaction()
    seen_after_commit = _drain(consumer, want=10)

    assert seen_before_commit == [], "read_committed consumer saw an open transaction"
    assert sorted(r.value.decode() for r in seen_after_commit) == sorted(
        f"committed-{i}" for i in range(10)
    )
    producer.close()


def test_aborted_transaction_is_never_seen_by_read_committed(kafka_settings, consumers):
    topic = _topic(kafka_settings, partitions=1)
    producer = KafkaProducer(
        bootstrap_servers=kafka_settings.kafka_bootstrap_servers,
        transactional_id=f"tx-{topic}",
    )
    producer.init_transactions()
    producer.begin_transaction()
    producer.send(topic, value=b"aborted")
    producer.flush()
    producer.abort_transaction()
    producer.begin_transaction()
    producer.send(topic, value=b"kept")
    producer.commit_transaction()
    producer.close()

    records = _drain(consumers(topic, 1), want=1)
    time.sleep(0.5)  # give a wrongly-visible aborted record a chance to show up
    records += _drain(consumers(topic, 1), want=2, seconds=1.0)

    assert {r.value for r in records} == {b"kept"}
