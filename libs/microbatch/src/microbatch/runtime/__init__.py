"""The micro-batch runtime: pipeline definitions and the exactly-once batch protocol."""

from microbatch.runtime.batch import BatchOptions, BatchResult, BatchRunner, run_batch
from microbatch.runtime.faults import CRASH_POINTS, InjectedCrash
from microbatch.runtime.pipeline import (
    DeadLetterSink,
    Enrichment,
    EventTime,
    KafkaSink,
    KafkaSource,
    ParquetSink,
    Pipeline,
)
from microbatch.runtime.process import KeyedProcessFunction, ProcessContext

__all__ = [
    "CRASH_POINTS",
    "BatchOptions",
    "BatchResult",
    "BatchRunner",
    "DeadLetterSink",
    "Enrichment",
    "EventTime",
    "InjectedCrash",
    "KafkaSink",
    "KafkaSource",
    "KeyedProcessFunction",
    "ParquetSink",
    "Pipeline",
    "ProcessContext",
    "run_batch",
]
