"""Which source task reads which partition: Flink's Kafka partition assigner (seed 002).

Partition 0 of a topic goes to a task derived from the topic name, and the following
partitions go round-robin to the following tasks::

    start = ((java_string_hash(topic) * 31) & 0x7FFFFFFF) % num_tasks
    task  = (start + partition) % num_tasks

so every task gets ⌊n/P⌋ or ⌈n/P⌉ partitions of each topic, and different topics start at
different tasks. It uses Java's ``String.hashCode`` (never Python's salted ``hash()``) so the
mapping is stable across processes and agrees with Flink. Because every checkpoint stores
the offsets of all partitions, the parallelism may change between any two batches.

Seed example: ``"test-topic"`` with 11 partitions over 5 tasks puts partition 0 on task 1
and gives task 0 partitions 4 and 9; over 6 tasks partition 0 is on task 0, which then
reads partitions 0 and 6.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TypeVar

from microbatch.errors import SourceError

_MASK32 = 0xFFFFFFFF
_TP = TypeVar("_TP", bound=tuple[str, int])


def java_string_hash(s: str) -> int:
    """Java's ``String.hashCode``: ``h = 31*h + c`` over UTF-16 code units, signed 32-bit."""
    h = 0
    data = s.encode("utf-16-be", "surrogatepass")
    for i in range(0, len(data), 2):
        h = (31 * h + ((data[i] << 8) | data[i + 1])) & _MASK32
    return h - (1 << 32) if h & 0x80000000 else h


def _check_num_tasks(num_tasks: int) -> None:
    if not isinstance(num_tasks, int) or num_tasks < 1:
        raise SourceError(f"source parallelism must be ≥ 1, got {num_tasks!r}")


def source_task(topic: str, partition: int, num_tasks: int) -> int:
    """The task in ``[0, num_tasks)`` that reads ``topic[partition]``."""
    _check_num_tasks(num_tasks)
    if partition < 0:
        raise SourceError(f"{topic}[{partition}]: partition must be ≥ 0")
    # Java: int overflow on hash * 31, then the sign bit masked off.
    start = ((java_string_hash(topic) * 31) & 0x7FFFFFFF) % num_tasks
    return (start + partition) % num_tasks


def partitions_for_task(partitions: Iterable[_TP], task: int, num_tasks: int) -> list[_TP]:
    """The ``(topic, partition)`` pairs of ``partitions`` that ``task`` reads, sorted."""
    _check_num_tasks(num_tasks)
    if not 0 <= task < num_tasks:
        raise SourceError(f"source task {task} is out of range for parallelism {num_tasks}")
    return sorted(tp for tp in partitions if source_task(tp[0], tp[1], num_tasks) == task)
