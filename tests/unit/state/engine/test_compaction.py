"""The merge policy keeps runs few and rewrites each byte about once per size tier."""

from __future__ import annotations

import math

import pytest

from microbatch.state.engine.compaction import runs_to_merge


def simulate(batches: int, batch_bytes: int = 100, **policy) -> tuple[list[int], int]:
    """Runs (newest first) and bytes written after ``batches`` equal batches."""
    runs: list[int] = []
    written = 0
    for _ in range(batches):
        runs.insert(0, batch_bytes)
        written += batch_bytes
        n = runs_to_merge(runs, **policy)
        if n:
            merged = sum(runs[:n])
            runs[:n] = [merged]
            written += merged
    return runs, written


def test_four_runs_of_one_size_merge_into_one() -> None:
    assert runs_to_merge([10, 10, 10]) == 0
    assert runs_to_merge([10, 10, 10, 10]) == 4
    assert runs_to_merge([10, 10, 10, 10, 40]) == 5  # 40 is no bigger than what came before
    assert runs_to_merge([10, 10, 10, 40]) == 0  # 40 > 1.25 x 30: a tier of its own


def test_runs_stay_few_and_each_byte_is_rewritten_once_per_tier() -> None:
    runs, written = simulate(1000)
    tiers = math.log(1000, 4)

    assert len(runs) <= 3 * math.ceil(tiers)
    assert written / (1000 * 100) <= 1 + tiers + 0.5
    assert sum(runs) == 1000 * 100  # merging never loses bytes in this model


def test_over_twenty_batches_the_writes_stay_within_three_times_the_changes() -> None:
    _, written = simulate(20)
    assert written / (20 * 100) <= 3


def test_uneven_sizes_are_still_bounded_by_max_runs() -> None:
    sizes = [2**i for i in range(30)]  # each run twice the newer one: never a tier
    assert runs_to_merge(sizes, max_runs=24) == 7


def test_a_policy_that_cannot_work_is_refused() -> None:
    with pytest.raises(ValueError):
        runs_to_merge([1], min_width=1)
