"""Keyed steps that read nothing of each other (a source's branches) run in one level:
one exchange for all of them. Each step still sees exactly its own records, and every
dead letter of the level's steps is staged once, whether the level is followed by
another step or is the last."""

from __future__ import annotations

import json
from typing import Any

import pytest

from microbatch.dataflow import Dataflow
from microbatch.runtime import (
    BatchOptions,
    BatchRunner,
    DeadLetterSink,
    KafkaSource,
    KeyedProcessFunction,
    ParquetSink,
)
from microbatch.runtime.spine import step_levels
from microbatch.runtime.stage_two import StageTwo
from microbatch.sinks import read_parquet_sink
from tests.integration.runtime.test_batches import new_topic, produce

pytestmark = pytest.mark.integration

VALUES = [
    json.dumps({"card": f"c{i % 4}", "merchant": f"m{i % 3}", "amount": i}).encode()
    for i in range(1, 61)
] + [b"not json"]


class Refuse(KeyedProcessFunction):
    """Dead-letters the payments whose amount ``divisor`` divides; emits the others."""

    def __init__(self, divisor: int) -> None:
        self.divisor = divisor

    def process(self, key: Any, records: Any, ctx: Any) -> None:
        for p in records:
            if p["amount"] % self.divisor == 0:
                ctx.dead_letter(f"divisible_by_{self.divisor}", "refused", p)
            else:
                ctx.emit(p)


class Count(KeyedProcessFunction):
    def process(self, key: Any, records: Any, ctx: Any) -> None:
        n = ctx.value("n")
        n.set(n.get(0) + len(records))
        ctx.emit({"key": key, "n": n.get()})


@pytest.fixture(scope="module")
def topic(bootstrap, admin) -> str:
    name = new_topic(admin, 2)
    produce(bootstrap, name, VALUES)
    return name


def branches(topic: str, root: str, *, then: bool) -> Any:
    """source → per card (refuses amounts divisible by 5) [→ per card again: counts];
    source → per merchant (refuses amounts divisible by 7)."""
    dead = DeadLetterSink(path=f"{root}/dead")
    flow = Dataflow("levels", checkpoints=f"{root}/checkpoints", dead_letters=dead, parallelism=2)
    payments = flow.source(KafkaSource(topics=(topic,)))
    cards = payments.key_by("card").process(Refuse(5), uid="cards")
    cards.to(ParquetSink("cards", f"{root}/cards"))
    payments.key_by("merchant").process(Refuse(7), uid="merchants").to(
        ParquetSink("merchants", f"{root}/merchants")
    )
    if then:
        cards.key_by("card").process(Count(), uid="counts").to(
            ParquetSink("counts", f"{root}/counts")
        )
    return flow.build()


@pytest.mark.parametrize("then", [True, False], ids=["level-then-step", "last-level"])
def test_a_level_of_branches_keeps_each_steps_records_and_stages_each_dead_letter_once(
    spark, kafka_settings, topic, tmp_path, then: bool
) -> None:
    pipe = branches(topic, str(tmp_path), then=then)
    stage = StageTwo(pipe, kafka_settings, 0, 2, None, None, 0)
    levels = [[s.step or pipe.uid for s in level] for level in step_levels(stage)]
    assert levels == ([["cards", "merchants"], ["counts"]] if then else [["cards", "merchants"]])

    BatchRunner(spark, pipe, kafka_settings).run(BatchOptions(run_id="r0"))

    amounts = range(1, 61)
    cards = read_parquet_sink(str(tmp_path / "cards")).to_pylist()
    merchants = read_parquet_sink(str(tmp_path / "merchants")).to_pylist()
    assert sorted(p["amount"] for p in cards) == [a for a in amounts if a % 5]
    assert sorted(p["amount"] for p in merchants) == [a for a in amounts if a % 7]
    dead = read_parquet_sink(str(tmp_path / "dead")).to_pylist()
    assert sorted(d["reason"] for d in dead) == sorted(
        ["undecodable"]
        + ["divisible_by_5"] * sum(1 for a in amounts if a % 5 == 0)
        + ["divisible_by_7"] * sum(1 for a in amounts if a % 7 == 0)
    )
    if then:
        counts = read_parquet_sink(str(tmp_path / "counts")).to_pylist()
        per_card = {f"c{c}": sum(1 for a in amounts if a % 4 == c % 4 and a % 5) for c in range(4)}
        assert {r["key"]: r["n"] for r in counts} == per_card
