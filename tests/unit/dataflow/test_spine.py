"""Which rows a keyed step takes as its own, and which ride on to a later step."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.compute as pc
import pytest

from microbatch.dataflow import Dataflow
from microbatch.errors import BatchError
from microbatch.runtime import EventTime, KafkaSource, ParquetSink, Pipeline
from microbatch.runtime.envelope import DEAD_LETTER, ENVELOPE_SCHEMA, RECORD, STAT
from microbatch.runtime.spine import (
    rows_for_later,
    step_instance,
    topics_for_later,
    topics_for_later_than,
)
from microbatch.runtime.stage_two import StageTwo
from microbatch.runtime.wire import Tags, tags_of
from microbatch.settings import Settings
from tests.unit.runtime.test_stage_one import Noop


def graph() -> Pipeline:
    """orders -> totals, re-keyed and joined with payments in ledger."""
    flow = Dataflow("spine", checkpoints="/tmp/spine", event_time=EventTime("ts"))
    orders = flow.source(KafkaSource(topics=("orders",))).key_by("account")
    payments = flow.source(KafkaSource(topics=("payments",))).key_by("account")
    totals = orders.process(Noop(), uid="totals")
    joined = totals.key_by("account").join(payments, Noop(), uid="ledger")
    joined.to(ParquetSink("o", "/tmp/o"))
    return flow.build()


def rows(tags: Tags, *kind_topic: tuple[str, str | None]) -> pa.Table:
    """Envelope rows as they cross an exchange: ``kind`` and ``topic`` as codes."""
    n = len(kind_topic)
    cols = {f.name: pa.nulls(n, f.type) for f in ENVELOPE_SCHEMA}
    cols["kind"] = pa.array([k for k, _ in kind_topic], pa.string())
    cols["topic"] = pa.array([t for _, t in kind_topic], pa.string())
    return tags.to_wire(pa.table(cols, schema=ENVELOPE_SCHEMA))


def later(table: pa.Table, step: str | None, tags: Tags) -> pa.ChunkedArray | None:
    return rows_for_later(table, topics_for_later(step, tags), tags)


def test_records_for_later_steps_ride_on_and_everything_else_stays() -> None:
    tags = tags_of(graph())
    table = rows(
        tags,
        (RECORD, "orders"),  # the first step's, from the source
        (RECORD, "payments>ledger"),  # a source's records for a later step
        (RECORD, "@totals>ledger"),
        (DEAD_LETTER, None),  # a dead letter of a step: no source coordinates
        (STAT, "orders"),
    )
    first = later(table, None, tags)
    assert first is not None and first.to_pylist() == [False, True, True, False, False]
    ledger = later(table, "ledger", tags)
    assert ledger is not None and ledger.to_pylist() == [False, False, False, False, False]
    kept = table.filter(pc.invert(ledger))
    assert DEAD_LETTER in tags.from_wire(kept).column("kind").to_pylist(), (
        "a dead letter was dropped"
    )


def test_a_chain_keeps_every_row_for_its_own_step() -> None:
    flow = Dataflow("chain", checkpoints="/tmp/chain", event_time=EventTime("ts"))
    keyed = flow.source(KafkaSource(topics=("orders",))).key_by("account")
    keyed.process(Noop(), uid="a").key_by("x").process(Noop(), uid="b").to(
        ParquetSink("o", "/tmp/o")
    )
    tags = tags_of(flow.build())
    first = later(rows(tags, (RECORD, "orders"), (DEAD_LETTER, None)), None, tags)
    assert first is None or first.to_pylist() == [False, False]
    second = later(rows(tags, (RECORD, "@a>b"), (DEAD_LETTER, None)), "b", tags)
    assert second is None or second.to_pylist() == [False, False]


def test_a_step_refuses_rows_that_are_not_on_the_wire_codes() -> None:
    """Rows reach a keyed step only across an exchange, on their codes: string kinds
    mean a caller skipped :meth:`Tags.to_wire`, which must fail loudly, not misroute."""
    pipeline = graph()
    stage = StageTwo(pipeline, Settings.from_env(), 7, 2, None, None, 1_000_000)
    table = tags_of(pipeline).from_wire(rows(tags_of(pipeline), (RECORD, "orders")))
    with pytest.raises(BatchError, match="batch 7: a keyed step's rows must arrive on the wire"):
        list(step_instance(stage)(iter(table.to_batches())))


def test_a_level_with_the_first_step_lets_records_for_a_step_named_none_ride_on() -> None:
    """The first step runs as step None: a later step whose uid is the string "None"
    must not be mistaken for it, or its records would be nobody's and be lost."""
    flow = Dataflow("lv", checkpoints="/tmp/lv", event_time=EventTime("ts"))
    payments = flow.source(KafkaSource(topics=("t",)))
    first = payments.key_by("card").process(Noop(), uid="a")
    payments.key_by("merchant").process(Noop(), uid="b")
    first.key_by("card").process(Noop(), uid="None").to(ParquetSink("o", "/tmp/o"))
    tags = tags_of(flow.build())
    table = rows(tags, (RECORD, "t"), (RECORD, "t>b"), (RECORD, "@a>None"), (STAT, "t"))

    riding = rows_for_later(table, topics_for_later_than([None, "b"], tags), tags)
    assert riding is not None and riding.to_pylist() == [False, False, True, False]
