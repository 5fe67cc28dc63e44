"""microbatch: Flink-grade semantics for Spark micro-batches scheduled by Airflow.

The public API is listed in ``__all__``; everything else is reachable through its
subpackage (``microbatch.checkpoint``, ``microbatch.storage``, ...) and may change.
``__version__`` is the installed distribution's version (``importlib.metadata``, so it
agrees with ``pip show microbatch``); a source tree that was never installed has no
metadata and says ``0+unknown``, a valid version that sorts before every release.
"""

from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as _distribution_version
from pkgutil import extend_path

# Other distributions add modules to this package: microbatch-dev (libs/microbatch-dev)
# ships microbatch.localstack, microbatch.demo and microbatch.examples, which executors
# never install. Wheels put both into one folder anyway; editable installs keep each in its
# own src/ on sys.path, so the package's path must take in every microbatch/ folder there.
__path__ = extend_path(__path__, __name__)

from microbatch.dataflow import Dataflow
from microbatch.errors import (
    BatchError,
    CheckpointError,
    ConfigError,
    DataLossError,
    EnrichmentError,
    ExitCode,
    LeaseError,
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


def _installed_version(distribution: str = "microbatch") -> str:
    """The installed version of ``distribution``, else ``0+unknown``."""
    try:
        return _distribution_version(distribution)
    except PackageNotFoundError:
        return "0+unknown"


__version__ = _installed_version()

__all__ = [
    "BatchError",
    "CheckpointError",
    "ConfigError",
    "DataLossError",
    "Dataflow",
    "DeadLetterSink",
    "Enrichment",
    "EnrichmentError",
    "EventTime",
    "ExitCode",
    "KafkaSink",
    "KafkaSource",
    "KeyGroupRange",
    "KeyedProcessFunction",
    "KeyedStateBackend",
    "LeaseError",
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
    "__version__",
    "key_group",
    "key_group_range",
    "open_store",
    "operator_index",
]
