"""microbatch: Flink-grade semantics for Spark micro-batches scheduled by Airflow."""

from microbatch.errors import (
    CheckpointError,
    ConfigError,
    EnrichmentError,
    MicrobatchError,
    ServiceError,
    SinkError,
    SourceError,
    StateError,
    StorageError,
)
from microbatch.settings import Settings

__all__ = [
    "CheckpointError",
    "ConfigError",
    "EnrichmentError",
    "MicrobatchError",
    "ServiceError",
    "Settings",
    "SinkError",
    "SourceError",
    "StateError",
    "StorageError",
]
