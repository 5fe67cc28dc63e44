"""The micro-batch runtime: pipeline definitions and the exactly-once batch protocol.

Defining a pipeline imports no Spark or Kafka client; the batch machinery (Spark, Kafka clients,
Arrow) loads on first use of :class:`BatchRunner` and friends.
"""

from typing import TYPE_CHECKING, Any

from microbatch.runtime.faults import CRASH_POINTS, InjectedCrash
from microbatch.runtime.pipeline import Enrichment, EventTime, KafkaSource, Pipeline
from microbatch.runtime.process import KeyedProcessFunction, ProcessContext
from microbatch.runtime.schema import JsonSchema
from microbatch.sinks import DeadLetterSink, KafkaSink, ParquetSink

_BATCH_NAMES = ("BatchOptions", "BatchResult", "BatchRunner", "run_batch")

if TYPE_CHECKING:  # their types, for type checkers and editors; loaded lazily at run time
    from microbatch.runtime.options import BatchOptions, BatchResult
    from microbatch.runtime.protocol import BatchRunner, run_batch


def __getattr__(name: str) -> Any:
    if name in _BATCH_NAMES:
        from microbatch.runtime import protocol

        return getattr(protocol, name)
    raise AttributeError(f"module 'microbatch.runtime' has no attribute {name!r}")


__all__ = [
    "CRASH_POINTS",
    "BatchOptions",
    "BatchResult",
    "BatchRunner",
    "DeadLetterSink",
    "Enrichment",
    "EventTime",
    "InjectedCrash",
    "JsonSchema",
    "KafkaSink",
    "KafkaSource",
    "KeyedProcessFunction",
    "ParquetSink",
    "Pipeline",
    "ProcessContext",
    "run_batch",
]
