"""The Kafka source: offsets, partition assignment, batch planning, reading and lag.

A batch reads fixed offset ranges that were planned (and stored) before any work ran, so a
rerun reads exactly the same records; the offsets of every partition go into the
checkpoint manifest; a consumer group mirrors them for standard lag tools. The ranges are
read by kafka-python (``read_ranges``), by confluent-kafka (``read_range_confluent``), by
microbatch's native reader (``read_range_native``, librdkafka into Arrow in Rust) or by
Spark's own Kafka source in the JVM (``read_ranges_spark``), with the same records.
See ``docs/kafka-source.md``.
"""

from microbatch.kafka.assignment import java_string_hash, partitions_for_task, source_task
from microbatch.kafka.confluent_reader import read_range_confluent
from microbatch.kafka.lag import consumer_group_name, mirror_offsets, partition_lag
from microbatch.kafka.native_reader import read_range_native
from microbatch.kafka.offsets import (
    OffsetRange,
    TopicPartition,
    snapshot_from_json,
    snapshot_to_json,
)
from microbatch.kafka.planner import (
    BatchLimits,
    BatchPlan,
    BrokerView,
    KafkaBrokerView,
    PlanStore,
    StartingPosition,
    plan_batch,
)
from microbatch.kafka.reader import KAFKA_SCHEMA, KAFKA_SPARK_SCHEMA, read_range, read_ranges
from microbatch.kafka.spark_source import read_ranges_spark

__all__ = [
    "KAFKA_SCHEMA",
    "KAFKA_SPARK_SCHEMA",
    "BatchLimits",
    "BatchPlan",
    "BrokerView",
    "KafkaBrokerView",
    "OffsetRange",
    "PlanStore",
    "StartingPosition",
    "TopicPartition",
    "consumer_group_name",
    "java_string_hash",
    "mirror_offsets",
    "partition_lag",
    "partitions_for_task",
    "plan_batch",
    "read_range",
    "read_range_confluent",
    "read_range_native",
    "read_ranges",
    "read_ranges_spark",
    "snapshot_from_json",
    "snapshot_to_json",
    "source_task",
]
