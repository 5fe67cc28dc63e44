"""microbatch: Flink-grade semantics for Spark micro-batches scheduled by Airflow.

The public API is listed in ``__all__``; everything else is reachable through its
subpackage (``microbatch.checkpoint``, ``microbatch.storage``, ...) and may change.
"""

from microbatch.errors import (
    BatchError,
    CheckpointError,
    ConfigError,
    EnrichmentError,
    MicrobatchError,
    ProcessError,
    ServiceError,
    SinkError,
    SourceError,
    StateError,
    StorageError,
)
from microbatch.keygroups import KeyGroupRange, key_group, key_group_range, operator_index
from microbatch.runtime import (
    DeadLetterSink,
    Enrichment,
    EventTime,
    KafkaSink,
    KafkaSource,
    KeyedProcessFunction,
    ParquetSink,
    Pipeline,
    ProcessContext,
)
from microbatch.settings import Settings
from microbatch.state import KeyedStateBackend, ListState, MapState, ValueState
from microbatch.storage import ObjectStore, open_store

__all__ = [
    "BatchError",
    "CheckpointError",
    "ConfigError",
    "DeadLetterSink",
    "Enrichment",
    "EnrichmentError",
    "EventTime",
    "KafkaSink",
    "KafkaSource",
    "KeyGroupRange",
    "KeyedProcessFunction",
    "KeyedStateBackend",
    "ListState",
    "MapState",
    "MicrobatchError",
    "ObjectStore",
    "ParquetSink",
    "Pipeline",
    "ProcessContext",
    "ProcessError",
    "ServiceError",
    "Settings",
    "SinkError",
    "SourceError",
    "StateError",
    "StorageError",
    "ValueState",
    "key_group",
    "key_group_range",
    "open_store",
    "operator_index",
]
