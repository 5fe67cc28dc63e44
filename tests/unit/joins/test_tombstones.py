"""Kafka tombstones into a TableJoin: which pipelines may take them (refused when built
otherwise), and what stage 1 makes of them — a ``None`` record keyed by its Kafka key."""

from __future__ import annotations

import json

import pyarrow as pa
import pytest

from microbatch.dataflow import Dataflow
from microbatch.errors import ConfigError
from microbatch.joins import TableJoin, TemporalJoin
from microbatch.kafka import KAFKA_SCHEMA
from microbatch.keygroups import encode_key, key_group_of_bytes
from microbatch.runtime import (
    DeadLetterSink,
    EventTime,
    JsonSchema,
    KafkaSource,
    KeyedProcessFunction,
    ParquetSink,
)
from microbatch.runtime.column_plan import columnar_values
from microbatch.runtime.envelope import DeadLetterDetail, decode_payload
from microbatch.runtime.stage_one import StageOne

ORDERS, CUSTOMERS = "orders", "customers"


def flow(**settings) -> Dataflow:
    return Dataflow(
        "tomb",
        checkpoints="/tmp/cp",
        dead_letters=DeadLetterSink(path="/tmp/dl"),
        max_parallelism=16,
        parallelism=2,
        **settings,
    )


def table_join(changelog: KafkaSource, *, event_time: EventTime | None = None, **join):
    f = flow(event_time=event_time)
    orders = f.source(KafkaSource(topics=(ORDERS,))).key_by("customer")
    customers = f.source(changelog).key_by("id")
    orders.join(customers, TableJoin(how="left", **join), uid="enrich").to(
        ParquetSink("out", "/tmp/out")
    )
    return f.build()


def kafka_rows(rows: list[tuple[str, bytes | None, bytes | None]]) -> pa.RecordBatch:
    """Kafka rows (topic, key, value) of partition 0, offsets from 10."""
    n = len(rows)
    return pa.RecordBatch.from_pydict(
        {
            "key": [k for _, k, _ in rows],
            "value": [v for _, _, v in rows],
            "topic": [t for t, _, _ in rows],
            "partition": [0] * n,
            "offset": list(range(10, 10 + n)),
            "timestamp": [0] * n,
            "headers": [[] for _ in range(n)],
        },
        schema=KAFKA_SCHEMA,
    )


def stage_one(pipeline, rows):
    out = StageOne(pipeline, parallelism=2, watermark=None).envelopes(kafka_rows(rows))
    return [r for r in out.to_pylist() if r["kind"] != "stat"]


def customer(cid: str) -> bytes:
    return json.dumps({"id": cid, "city": "Oslo", "ts": 5}).encode()


# When a pipeline is built --------------------------------------------------------------


def test_a_changelog_with_tombstones_builds_as_the_table_side_of_a_table_join() -> None:
    pipeline = table_join(KafkaSource(topics=(CUSTOMERS,), tombstones=True))
    assert [i.source.tombstones for i in pipeline.inputs] == [False, True]
    assert pipeline.source.tombstones is False  # the combined read: each input's own


def test_tombstones_into_the_stream_side_of_a_table_join_are_refused() -> None:
    f = flow()
    orders = f.source(KafkaSource(topics=(ORDERS,), tombstones=True)).key_by("customer")
    customers = f.source(KafkaSource(topics=(CUSTOMERS,))).key_by("id")
    orders.join(customers, TableJoin(), uid="enrich").to(ParquetSink("out", "/tmp/out"))
    with pytest.raises(ConfigError, match=r"\['orders'\] has tombstones=True.*input 0 of step "
                       r"'enrich' \(TableJoin\)"):  # fmt: skip
        f.build()


def test_tombstones_into_a_temporal_join_are_refused_it_deletes_no_version() -> None:
    f = flow(event_time=EventTime("ts"))
    orders = f.source(KafkaSource(topics=(ORDERS,))).key_by("customer")
    rates = f.source(KafkaSource(topics=(CUSTOMERS,), tombstones=True)).key_by("id")
    orders.join(rates, TemporalJoin("ts", "ts", "1h"), uid="asof").to(ParquetSink("o", "/tmp/o"))
    with pytest.raises(ConfigError, match=r"input 1 of step 'asof' \(TemporalJoin\), which does "
                       "not take None records"):  # fmt: skip
        f.build()


def test_tombstones_through_a_stateless_step_or_to_a_sink_or_no_join_are_refused() -> None:
    f = flow()
    orders = f.source(KafkaSource(topics=(ORDERS,))).key_by("customer")
    changelog = f.source(KafkaSource(topics=(CUSTOMERS,), tombstones=True))
    customers = changelog.map(lambda r: r, name="copy").key_by("id")
    orders.join(customers, TableJoin(), uid="enrich").to(ParquetSink("out", "/tmp/out"))
    with pytest.raises(ConfigError, match=r"stateless steps \(copy\) before step 'enrich'"):
        f.build()

    f = flow()
    orders = f.source(KafkaSource(topics=(ORDERS,))).key_by("customer")
    changelog = f.source(KafkaSource(topics=(CUSTOMERS,), tombstones=True))
    changelog.to(ParquetSink("raw", "/tmp/raw"))
    orders.join(changelog.key_by("id"), TableJoin(), uid="enrich").to(ParquetSink("o", "/tmp/o"))
    with pytest.raises(ConfigError, match="feeds sink 'raw' directly"):
        f.build()

    f = flow()
    f.source(KafkaSource(topics=(CUSTOMERS,), tombstones=True)).key_by("id").process(
        Latest(), uid="latest"
    )
    with pytest.raises(ConfigError, match=r"\['customers'\] has tombstones=True, but its "
                       "records go to no join"):  # fmt: skip
        f.build()


class Latest(KeyedProcessFunction):
    def process(self, key, records, ctx) -> None:
        ctx.value("latest").set(records[-1])


def test_tombstone_settings_are_checked_on_the_source() -> None:
    with pytest.raises(ConfigError, match=r"tombstone_key .* needs tombstones=True"):
        KafkaSource(topics=("t",), tombstone_key=int)
    with pytest.raises(ConfigError, match="tombstones must be True or False"):
        KafkaSource(topics=("t",), tombstones="yes")


def test_a_pipeline_with_tombstones_never_takes_the_columnar_stage_one_path() -> None:
    schema = JsonSchema({"id": "string", "city": "string", "ts": "long"})
    pipeline = table_join(KafkaSource(topics=(CUSTOMERS,), value_schema=schema, tombstones=True))
    assert columnar_values(pipeline) is None  # two inputs: records travel as payloads
    rows = stage_one(pipeline, [(CUSTOMERS, b"c1", customer("c1")), (CUSTOMERS, b"c1", None)])
    assert [r["kind"] for r in rows] == ["record", "record"]
    assert decode_payload(rows[0]["payload"]) == {"id": "c1", "city": "Oslo", "ts": 5}
    assert decode_payload(rows[1]["payload"]) is None


# Stage 1 -------------------------------------------------------------------------------


def test_a_tombstone_is_a_none_record_keyed_by_its_kafka_key_like_the_updates() -> None:
    pipeline = table_join(KafkaSource(topics=(CUSTOMERS,), tombstones=True))
    rows = stage_one(
        pipeline,
        [(CUSTOMERS, b"c1", customer("c1")), (CUSTOMERS, b"c1", None), (ORDERS, None, None)],
    )
    update, tombstone, order = rows
    assert update["kind"] == tombstone["kind"] == "record"
    assert tombstone["key"] == update["key"] == encode_key("c1")
    assert tombstone["key_group"] == update["key_group"] == key_group_of_bytes(encode_key("c1"), 16)
    assert tombstone["instance"] == update["instance"]
    assert tombstone["topic"] == update["topic"]  # both for the join's table side
    assert decode_payload(tombstone["payload"]) is None
    assert (tombstone["offset"], tombstone["event_ts"]) == (11, None)
    # A null value of a source without tombstones=True stays a dead letter.
    assert order["kind"] == "dead_letter"
    assert DeadLetterDetail.from_payload(order["payload"]).reason == "undecodable"


def test_tombstones_need_no_event_time_in_a_pipeline_that_has_one() -> None:
    pipeline = table_join(
        KafkaSource(topics=(CUSTOMERS,), tombstones=True), event_time=EventTime("ts")
    )
    rows = stage_one(pipeline, [(CUSTOMERS, b"c1", customer("c1")), (CUSTOMERS, b"c1", None)])
    assert [(r["kind"], r["event_ts"]) for r in rows] == [("record", 5), ("record", None)]


def test_tombstone_key_reads_the_kafka_key_as_the_join_key() -> None:
    pipeline = table_join(KafkaSource(topics=(CUSTOMERS,), tombstones=True, tombstone_key=int))
    update = json.dumps({"id": 42, "city": "Oslo"}).encode()
    rows = stage_one(pipeline, [(CUSTOMERS, b"42", update), (CUSTOMERS, b"42", None)])
    assert rows[0]["key"] == rows[1]["key"] == encode_key(42)


def test_a_tombstone_without_a_readable_kafka_key_is_a_dead_letter() -> None:
    pipeline = table_join(KafkaSource(topics=(CUSTOMERS,), tombstones=True))
    rows = stage_one(pipeline, [(CUSTOMERS, None, None), (CUSTOMERS, b"\xff\xfe", None)])
    details = [DeadLetterDetail.from_payload(r["payload"]) for r in rows]
    assert [r["kind"] for r in rows] == ["dead_letter", "dead_letter"]
    assert [d.reason for d in details] == ["missing_key", "bad_key"]
    assert "no Kafka key" in details[0].error
    assert "UnicodeDecodeError" in details[1].error
    assert details[1].raw_key == b"\xff\xfe"
