"""Dataflows without keyed steps: source → steps → sinks. With a declared schema and
column steps, stage 1 sends each sink its rows as columns and stage 2 hands the sink one
table per instance, in source order; otherwise records travel as today's payloads."""

from __future__ import annotations

import json
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pytest

from microbatch.dataflow import Dataflow, Stream
from microbatch.errors import ConfigError
from microbatch.runtime import DeadLetterSink, JsonSchema, KafkaSource, ParquetSink
from microbatch.runtime.column_plan import columnar_values, tap_values
from microbatch.runtime.column_taps import tap_tables
from microbatch.runtime.envelope import (
    DeadLetterDetail,
    decode_payload,
    partition_stats,
    unkeyed_instance,
)
from microbatch.runtime.pipeline import Pipeline
from microbatch.runtime.stage_one import StageOne
from microbatch.runtime.steps import sink_only
from tests.unit.runtime.test_stage_one import kafka_batch

SCHEMA = JsonSchema({"auction": "long", "bidder": "long", "price": "long"})


def bid(**fields: Any) -> bytes:
    return json.dumps(fields).encode()


def flow_of(schema: JsonSchema | None = SCHEMA) -> tuple[Dataflow, Stream]:
    flow = Dataflow("etl", checkpoints="/tmp/x", dead_letters=DeadLetterSink(path="/tmp/dl"))
    return flow, flow.source(KafkaSource(topics=("t",), value_schema=schema))


def q2_like() -> Pipeline:
    flow, bids = flow_of()
    auction = pc.field("auction")
    bids.where(auction - auction / 123 * 123 == 0).select("auction", "price").to(
        ParquetSink("q2", "/tmp/q2")
    )
    bids.select("bidder", euros=pc.field("price") * 0.908).to(ParquetSink("q1", "/tmp/q1"))
    return flow.build()


def test_each_sink_gets_its_columns_as_a_table_per_instance_in_source_order() -> None:
    pipeline = q2_like()
    values = [bid(auction=i * 41, bidder=i, price=100 + i) for i in range(20)]
    values[5] = bid(auction=1, price="x", bidder=1)  # a dead letter, for every sink

    out = StageOne(pipeline, parallelism=3, watermark=None).envelopes(kafka_batch(values))
    table = pa.Table.from_batches([out])

    assert sink_only(pipeline) and tap_values(pipeline) is not None
    assert columnar_values(pipeline).names == ["auction", "price", "bidder", "euros"]
    outputs = table.filter(pc.equal(table.column("kind"), "output"))
    assert outputs.column("payload").null_count == outputs.num_rows  # columns, no payload
    got: dict[str, list[dict[str, Any]]] = {"q1": [], "q2": []}
    for instance in range(3):
        mine = outputs.filter(pc.equal(outputs.column("instance"), instance))
        assert set(mine.column("offset").to_pylist()) == {
            100 + i for i in range(20) if i != 5 and unkeyed_instance(1, 100 + i, 3) == instance
        }
        for sink, rows in tap_tables(pipeline, mine.sort_by("offset")).items():
            got[sink] += rows.to_pylist()
    ok = [i for i in range(20) if i != 5]
    assert sorted(got["q2"], key=str) == sorted(
        ({"auction": i * 41, "price": 100 + i} for i in ok if i * 41 % 123 == 0), key=str
    )
    assert sorted(got["q1"], key=lambda r: r["bidder"]) == [
        {"bidder": i, "euros": (100 + i) * 0.908} for i in ok
    ]
    dead = table.filter(pc.equal(table.column("kind"), "dead_letter")).to_pylist()
    assert [(r["offset"], DeadLetterDetail.from_payload(r["payload"]).reason) for r in dead] == [
        (105, "schema_mismatch")
    ]
    stats = table.filter(pc.equal(table.column("kind"), "stat")).column("payload").to_pylist()
    assert {partition_stats(p).inputs for p in stats} == {20}


def test_record_wise_steps_to_a_sink_travel_as_payloads() -> None:
    flow, bids = flow_of(schema=None)
    bids.filter(lambda b: b["price"] > 101).map(lambda b: {"p": b["price"]}).to(
        ParquetSink("out", "/tmp/out")
    )
    pipeline = flow.build()
    values = [bid(auction=1, bidder=1, price=100 + i) for i in range(4)]

    out = StageOne(pipeline, parallelism=2, watermark=None).envelopes(kafka_batch(values))
    rows = [r for r in out.to_pylist() if r["kind"] != "stat"]

    assert tap_values(pipeline) is None
    assert [(r["kind"], decode_payload(r["payload"])) for r in rows] == [
        ("output", {"p": 102}),
        ("output", {"p": 103}),
    ]


def test_a_source_straight_to_a_sink_travels_as_columns() -> None:
    flow, bids = flow_of()
    bids.to(ParquetSink("out", "/tmp/out"))

    assert tap_values(flow.build()) == {"out": SCHEMA.arrow_schema}


@pytest.mark.parametrize(
    ("write", "error"),
    [
        (lambda f, s: None, r"no keyed step and no sink"),
        (
            lambda f, s: (
                s.select("auction").to(ParquetSink("a", "/tmp/a")),
                s.select(auction=pc.field("price") * 0.908).to(ParquetSink("b", "/tmp/b")),
            ),
            r"sinks 'a' and 'b' take column 'auction' as int64 and double; rename one",
        ),
        (
            lambda f, s: (
                s.select("auction").to(ParquetSink("a", "/tmp/a")),
                s.filter(lambda b: True).to(ParquetSink("b", "/tmp/b")),
            ),
            r"sink 'a' takes columns .* and sink 'b' records",
        ),
        (
            lambda f, s: (
                s.to(ParquetSink("a", "/tmp/a")),
                f.source(KafkaSource(topics=("u",))).to(ParquetSink("b", "/tmp/b")),
            ),
            r"without keyed steps reads one source",
        ),
    ],
)
def test_what_cannot_work_is_refused_when_built(write: Any, error: str) -> None:
    flow, bids = flow_of()
    write(flow, bids)
    with pytest.raises(ConfigError, match=error):
        flow.build()
