"""Changing a dataflow between batches: adding a step is allowed; removing, renaming or
re-typing a step with state is refused unless its state is dropped on purpose."""

from __future__ import annotations

from typing import Any

import pytest

from microbatch.checkpoint.writer import build_manifest
from microbatch.dataflow import Dataflow
from microbatch.errors import CheckpointError
from microbatch.runtime import KafkaSource, KeyedProcessFunction, ParquetSink, Pipeline
from microbatch.runtime.lineage import dropped_steps
from tests.unit.dataflow.test_steps import snapshot


class Spend(KeyedProcessFunction):
    def process(self, key: Any, records: Any, ctx: Any) -> None: ...


class Risk(KeyedProcessFunction):
    def process(self, key: Any, records: Any, ctx: Any) -> None: ...


def dataflow(*steps: tuple[str, KeyedProcessFunction], first: str = "spend", **kw: Any) -> Pipeline:
    flow = Dataflow("pay", checkpoints="/tmp/cp", max_parallelism=4, **kw)
    s = flow.source(KafkaSource(topics=("t",))).key_by("card").process(Spend(), uid=first)
    s.to(ParquetSink("first", "/tmp/first"))
    for uid, fn in steps:
        s = s.key_by("merchant").process(fn, uid=uid)
        s.to(ParquetSink(uid, f"/tmp/{uid}"))
    return flow.build()


def checkpoint_of(pipe: Pipeline):
    return build_manifest(
        3,
        [snapshot(0, 1, 4, "first")],
        max_parallelism=4,
        pipeline_fingerprint=pipe.fingerprint(),
        base=None,
        full=True,
        operators={s.uid: [snapshot(0, 1, 4, s.uid)] for s in pipe.steps},
        step_types=pipe.step_types(),
        first_uid=pipe.uid,
    )


def test_adding_a_step_keeps_every_state() -> None:
    base = checkpoint_of(dataflow(("merchant", Risk())))
    assert dropped_steps(dataflow(("merchant", Risk()), ("audit", Risk())), base) == set()


def test_removing_a_step_with_state_is_refused_naming_it() -> None:
    base = checkpoint_of(dataflow(("merchant", Risk())))
    with pytest.raises(CheckpointError, match="state of keyed step\\(s\\) 'merchant', which the"):
        dropped_steps(dataflow(), base)


def test_removing_it_with_drop_state_drops_that_state_only() -> None:
    base = checkpoint_of(dataflow(("merchant", Risk()), ("audit", Risk())))
    pipe = dataflow(("audit", Risk()), drop_state=("merchant",))
    assert dropped_steps(pipe, base) == {"merchant"}


def test_renaming_a_uid_is_refused_with_the_old_and_new_names() -> None:
    base = checkpoint_of(dataflow(("merchant", Risk())))
    with pytest.raises(CheckpointError, match=r"'merchant'.*new steps: 'merchants': a renamed uid"):
        dropped_steps(dataflow(("merchants", Risk())), base)
    with pytest.raises(CheckpointError, match=r"first keyed step 'spend'.*now 'spending'"):
        dropped_steps(dataflow(("merchant", Risk()), first="spending"), base)


def test_a_step_running_a_function_of_another_class_is_refused_then_reset_on_request() -> None:
    base = checkpoint_of(dataflow(("merchant", Risk())))
    with pytest.raises(CheckpointError, match=r"step 'merchant' ran .*Risk and now runs .*Spend"):
        dropped_steps(dataflow(("merchant", Spend())), base)
    retyped = dataflow(("merchant", Spend()), drop_state=("merchant",))
    assert dropped_steps(retyped, base) == {"merchant"}
    # Once a batch committed with the new class, its state is kept again.
    assert dropped_steps(retyped, checkpoint_of(retyped)) == set()


def test_a_single_operator_checkpoint_is_the_first_steps_state() -> None:
    legacy = Pipeline(
        name="pay", source=KafkaSource(topics=("t",)), key_by="card", process=Spend(),
        checkpoints="/tmp/cp", max_parallelism=4,
    )  # fmt: skip
    base = checkpoint_of(legacy)
    assert base.first_uid is None and base.operators == {}
    pipe = dataflow(("merchant", Risk()))
    assert pipe.fingerprint() == legacy.fingerprint()
    assert dropped_steps(pipe, base) == set()
    assert base.for_operator("merchant").runs == ()
