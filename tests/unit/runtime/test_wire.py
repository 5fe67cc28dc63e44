"""Envelope rows cross Spark's exchanges with ``kind`` and ``topic`` as integer codes and
come back as the same strings; a string the pipeline cannot carry fails loudly."""

from __future__ import annotations

import pickle
from typing import Any

import pyarrow as pa
import pytest

from microbatch.dataflow import Dataflow
from microbatch.errors import BatchError
from microbatch.runtime import EventTime, KafkaSource, ParquetSink, Pipeline
from microbatch.runtime.envelope import ENVELOPE_SCHEMA, envelope_schema, ticks
from microbatch.runtime.wire import KINDS, Tags, tags_of
from tests.unit.runtime.test_stage_one import Noop


def graph() -> Pipeline:
    """Two sources (one of two topics) into a join, re-keyed into a second step."""
    flow = Dataflow("wire", checkpoints="/tmp/wire", event_time=EventTime("ts"))
    cards = flow.source(KafkaSource(topics=("cards", "cards-eu"))).key_by("card")
    payments = flow.source(KafkaSource(topics=("payments",))).key_by("card")
    joined = cards.join(payments, Noop(), uid="joined")
    joined.key_by("merchant").process(Noop(), uid="merchants").to(ParquetSink("o", "/tmp/o"))
    return flow.build()


def rows(topics: list[Any], kinds: list[str]) -> pa.Table:
    n = len(topics)
    columns: dict[str, Any] = {f.name: pa.nulls(n, f.type) for f in ENVELOPE_SCHEMA}
    columns |= {"kind": pa.array(kinds), "topic": pa.array(topics, pa.string()),
                "instance": pa.array(range(n), pa.int32()),
                "payload": pa.array([b"p%d" % i for i in range(n)])}  # fmt: skip
    return pa.table(columns, schema=ENVELOPE_SCHEMA)


def test_every_topic_marker_uid_and_kind_of_a_graph_goes_and_comes_back() -> None:
    tags = tags_of(graph())
    topics = tags.topics.to_pylist()
    assert {"cards", "cards-eu", "payments", "@joined>merchants", "joined", "merchants", ""} <= set(
        topics
    )
    table = rows([*topics, None, None], [*(KINDS * 3)][: len(topics) + 2])

    wired = tags.to_wire(table)

    assert wired.schema.field("kind").type == pa.int8()
    assert wired.schema.field("topic").type == pa.int16()
    assert wired.schema == tags.wire_schema(ENVELOPE_SCHEMA)
    assert tags.from_wire(wired) == table
    assert tags.from_wire(table) is table  # never on the wire: as it is
    batch = table.to_batches()[0]
    assert tags.from_wire(tags.to_wire(batch)) == batch


def test_the_value_columns_of_a_declared_schema_ride_along_unchanged() -> None:
    schema = envelope_schema(pa.schema([("amount", pa.int64())]))
    table = ticks([0, 1], schema)

    wired = tags_of(graph()).to_wire(table)

    assert wired.schema.field("value_amount").type == pa.int64()
    assert tags_of(graph()).from_wire(wired) == table


def test_the_driver_and_a_task_agree_on_the_codes() -> None:
    pipeline = graph()
    driver = tags_of(pipeline)
    task = Tags(pickle.loads(pickle.dumps(pipeline)))
    table = rows(["payments", "@joined>merchants", ""], ["record", "record", "result"])

    assert task.from_wire(driver.to_wire(table)) == table
    assert driver.topic_of(driver.to_wire(table).column("topic")[1].as_py()) == (
        "@joined>merchants"
    )


def test_a_topic_the_pipeline_cannot_carry_fails_the_task_naming_it() -> None:
    table = rows(["payments", "elsewhere"], ["record", "record"])

    with pytest.raises(BatchError, match=r"pipeline 'wire': envelope topic \['elsewhere'\]"):
        tags_of(graph()).to_wire(table)
    with pytest.raises(BatchError, match=r"envelope kind \['mystery'\]"):
        tags_of(graph()).to_wire(rows(["payments"], ["mystery"]))
