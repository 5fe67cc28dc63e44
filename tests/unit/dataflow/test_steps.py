"""Stateless steps as the runtime runs them, and the state of every keyed step in one
manifest."""

from __future__ import annotations

import pytest

from microbatch.checkpoint import Manifest, OperatorState
from microbatch.checkpoint.writer import InstanceSnapshot, build_manifest
from microbatch.errors import CheckpointError
from microbatch.keygroups import key_group_range
from microbatch.runtime.steps import Stateless, StepFailed, run_chain
from microbatch.state.engine import RunRef


def test_a_chain_maps_filters_and_flat_maps_in_order() -> None:
    chain = (
        Stateless("flat_map", lambda r: [r, r + 10], "twice"),
        Stateless("filter", lambda r: r % 2 == 1, "odd"),
        Stateless("map", lambda r: r * 100, "scale"),
    )
    assert run_chain(chain, 1) == [100, 1100]
    assert run_chain(chain, 2) == []


def test_a_step_that_raises_is_named() -> None:
    chain = (Stateless("map", lambda r: r["missing"], "project"),)
    with pytest.raises(StepFailed, match="step 'project' raised KeyError"):
        run_chain(chain, {})


def test_a_flat_map_must_return_an_iterable_of_records() -> None:
    chain = (Stateless("flat_map", lambda r: {"a": 1}, "explode"),)
    with pytest.raises(StepFailed, match="flat_map must return an iterable of records, got dict"):
        run_chain(chain, 1)


def snapshot(index: int, p: int, maxp: int, uid: str) -> InstanceSnapshot:
    own = key_group_range(maxp, p, index)
    run = RunRef(f"state/1/{uid}-{index}.run.arrow", f"{uid}-{index}.index", own.start, own.end, 9)
    return InstanceSnapshot(
        index, own, {}, frozenset(), None, 9, runs=(run,), key_counts={kg: 1 for kg in own}
    )


def test_one_manifest_commits_every_step_and_reads_back_the_same() -> None:
    first = [snapshot(i, 2, 4, "first") for i in range(2)]
    steps = {"merchant": [snapshot(i, 2, 4, "merchant") for i in range(2)]}
    m = build_manifest(
        1, first, max_parallelism=4, pipeline_fingerprint="f", base=None, full=True,
        operators=steps,
    )  # fmt: skip
    again = Manifest.from_json(m.to_json(), "test")
    assert again == m
    assert again.operators["merchant"].key_counts == (1, 1, 1, 1)
    assert {r.data for r in again.operators["merchant"].runs} <= again.files()
    view = again.for_operator("merchant")
    assert view.runs == again.operators["merchant"].runs and view.operators == {}
    assert again.for_operator("new-step").runs == ()


def test_a_manifest_without_further_steps_reads_back_byte_for_byte() -> None:
    m = build_manifest(
        1, [snapshot(0, 1, 4, "a")], max_parallelism=4, pipeline_fingerprint="f", base=None,
        full=True,
    )  # fmt: skip
    assert b"operators" not in m.to_json()


def test_a_step_whose_runs_stray_outside_its_key_groups_is_refused() -> None:
    bad = snapshot(0, 2, 4, "m")
    stray = (RunRef("d", "i", 0, 3, 9),)
    bad = InstanceSnapshot(
        0, bad.key_groups, {}, frozenset(), None, 9, runs=stray, key_counts=bad.key_counts
    )
    with pytest.raises(CheckpointError, match="step 'm': instance 0 of 2"):
        build_manifest(
            1, [snapshot(i, 2, 4, "a") for i in range(2)], max_parallelism=4,
            pipeline_fingerprint="f", base=None, full=True,
            operators={"m": [bad, snapshot(1, 2, 4, "m")]},
        )  # fmt: skip


def test_a_step_with_key_counts_of_another_max_parallelism_is_refused() -> None:
    m = build_manifest(
        1, [snapshot(0, 1, 4, "a")], max_parallelism=4, pipeline_fingerprint="f", base=None,
        full=True,
    )  # fmt: skip
    with pytest.raises(CheckpointError, match="state of step 'x' must be sorted runs"):
        Manifest(**{**m.__dict__, "operators": {"x": OperatorState((), (0, 0))}})
