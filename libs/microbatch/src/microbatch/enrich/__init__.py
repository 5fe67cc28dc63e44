"""Async I/O enrichment: call external services for many records at once, Flink-style.

:class:`AsyncOperator` keeps up to ``capacity`` calls in flight, emits results in
ordered, unordered (watermark-bounded) or per-key order, applies timeouts, retries and a
failure policy, and snapshots its un-emitted inputs at a batch deadline so the next batch
re-issues them — each result is emitted exactly once. :func:`run_batch` drives it from
synchronous code; :mod:`microbatch.enrich.spark` runs it inside Spark tasks.
See ``docs/enrich.md``.
"""

from microbatch.enrich.elements import DeadLetter, Element, Output, PendingElement, Watermark
from microbatch.enrich.loop import BatchOutcome, new_event_loop, run_batch
from microbatch.enrich.metrics import EnrichMetrics
from microbatch.enrich.operator import AsyncOperator
from microbatch.enrich.queues import Entry, KeyOrderedQueue, OrderedQueue, UnorderedQueue
from microbatch.enrich.retry import (
    ExponentialBackoff,
    FixedDelay,
    NoRetry,
    RetryPredicate,
    RetryStrategy,
    retry_on_exception,
    retry_on_result,
)

__all__ = [
    "AsyncOperator",
    "BatchOutcome",
    "DeadLetter",
    "Element",
    "EnrichMetrics",
    "Entry",
    "ExponentialBackoff",
    "FixedDelay",
    "KeyOrderedQueue",
    "NoRetry",
    "OrderedQueue",
    "Output",
    "PendingElement",
    "RetryPredicate",
    "RetryStrategy",
    "UnorderedQueue",
    "Watermark",
    "new_event_loop",
    "retry_on_exception",
    "retry_on_result",
    "run_batch",
]
