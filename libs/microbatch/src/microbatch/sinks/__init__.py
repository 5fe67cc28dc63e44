"""Exactly-once outputs: Parquet files and Kafka topics, staged then published."""

from microbatch.sinks.deadletters import DEAD_LETTER_SCHEMA
from microbatch.sinks.kafka import last_published, publish_messages
from microbatch.sinks.parquet import committed_batches, read_parquet_sink

__all__ = [
    "DEAD_LETTER_SCHEMA",
    "committed_batches",
    "last_published",
    "publish_messages",
    "read_parquet_sink",
]
