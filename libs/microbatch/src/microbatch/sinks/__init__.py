"""Exactly-once outputs: the sink protocol and its implementations, one per module.

Every sink stages per instance before the checkpoint commits and publishes per batch after
it (:mod:`microbatch.sinks.base`); the runtime never asks which kind a sink is.
"""

from microbatch.sinks.base import PublishContext, Sink, StageContext, Staged
from microbatch.sinks.deadletters import DEAD_LETTER_SCHEMA, DEAD_LETTER_SINK, DeadLetterSink
from microbatch.sinks.delta import DeltaSink, read_delta_sink
from microbatch.sinks.iceberg import IcebergCatalog, IcebergSink, read_iceberg_sink
from microbatch.sinks.kafka import KafkaSink, last_published, publish_messages
from microbatch.sinks.parquet import ParquetSink, committed_batches, read_parquet_sink
from microbatch.sinks.postgres import PostgresSink

__all__ = [
    "DEAD_LETTER_SCHEMA",
    "DEAD_LETTER_SINK",
    "DeadLetterSink",
    "DeltaSink",
    "IcebergCatalog",
    "IcebergSink",
    "KafkaSink",
    "ParquetSink",
    "PostgresSink",
    "PublishContext",
    "Sink",
    "StageContext",
    "Staged",
    "committed_batches",
    "last_published",
    "publish_messages",
    "read_delta_sink",
    "read_iceberg_sink",
    "read_parquet_sink",
]
