"""Flink's partition → source task assignment (seed 002)."""

from __future__ import annotations

import random
import string

import pytest

from microbatch.errors import SourceError
from microbatch.kafka import java_string_hash, partitions_for_task, source_task

TEST_TOPIC = [("test-topic", p) for p in range(11)]


@pytest.mark.parametrize(
    ("text", "expected"),
    [  # values printed by Java's String.hashCode on this machine
        ("test-topic", 639758388),
        ("", 0),
        ("clicks", -1357714453),
        ("päge-😀-事件", 812788538),
        ("a-very-long-topic-name-that-overflows-many-times-0123456789", 1973318582),
    ],
)
def test_java_string_hash_matches_java(text, expected):
    assert java_string_hash(text) == expected


def test_source_task_seed_example_five_tasks_starts_partition_zero_on_task_one():
    assert source_task("test-topic", 0, 5) == 1
    assert [source_task(t, p, 5) for t, p in TEST_TOPIC] == [1, 2, 3, 4, 0, 1, 2, 3, 4, 0, 1]
    assert partitions_for_task(TEST_TOPIC, 0, 5) == [("test-topic", 4), ("test-topic", 9)]


def test_source_task_seed_example_six_tasks_task_zero_reads_zero_and_six():
    assert source_task("test-topic", 0, 6) == 0
    assert partitions_for_task(TEST_TOPIC, 0, 6) == [("test-topic", 0), ("test-topic", 6)]


@pytest.mark.parametrize("num_tasks", [1, 2, 3, 5, 7, 16])
def test_partitions_for_task_every_partition_exactly_once_and_balanced(num_tasks):
    rng = random.Random(num_tasks)
    parts = [
        ("".join(rng.choices(string.ascii_lowercase, k=8)), p)
        for _ in range(4)
        for p in range(rng.randrange(1, 40))
    ]
    per_task = [partitions_for_task(parts, t, num_tasks) for t in range(num_tasks)]
    flat = [tp for tasks in per_task for tp in tasks]
    assert sorted(flat) == sorted(parts)
    for topic in {t for t, _ in parts}:
        counts = [sum(1 for t, _ in tasks if t == topic) for tasks in per_task]
        assert max(counts) - min(counts) <= 1  # round-robin within a topic


def test_source_task_consecutive_partitions_go_to_consecutive_tasks():
    for p in range(30):
        assert source_task("orders", p + 1, 7) == (source_task("orders", p, 7) + 1) % 7


def test_partitions_for_task_accepts_topic_partition_namedtuples():
    from microbatch.kafka import TopicPartition

    tps = [TopicPartition("test-topic", p) for p in range(11)]
    got = partitions_for_task(tps, 0, 5)
    assert got == [TopicPartition("test-topic", 4), TopicPartition("test-topic", 9)]
    assert all(isinstance(tp, TopicPartition) for tp in got)


@pytest.mark.parametrize("num_tasks", [0, -1])
def test_source_task_bad_parallelism_raises_naming_value(num_tasks):
    with pytest.raises(SourceError, match=f"parallelism must be ≥ 1, got {num_tasks}"):
        source_task("t", 0, num_tasks)


@pytest.mark.parametrize("task", [-1, 3])
def test_partitions_for_task_task_out_of_range_raises(task):
    with pytest.raises(SourceError, match=f"task {task} is out of range for parallelism 3"):
        partitions_for_task(TEST_TOPIC, task, 3)
