"""Column steps (``where``/``select``) on the sources of a dataflow with several sources
or a graph: stage 1 decodes each such source's rows as columns, runs its steps and builds
records only of the rows kept, with the kept fields, which then go on as payloads. A join
gives what the same logic written record-wise gives; dead letters stay what they were;
what cannot work is refused when built, naming the step and the column."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pytest

from microbatch.dataflow import Dataflow, Stream
from microbatch.errors import ConfigError
from microbatch.joins import TableJoin
from microbatch.kafka import TopicPartition
from microbatch.runtime import (
    BatchRunner,
    DeadLetterSink,
    EventTime,
    JsonSchema,
    KafkaSource,
    ParquetSink,
    Pipeline,
)
from microbatch.runtime.column_plan import columns_read_by
from microbatch.runtime.envelope import DeadLetterDetail, decode_payload, partition_stats
from microbatch.runtime.stage_one import StageOne
from microbatch.settings import Settings
from microbatch.sinks import read_parquet_sink
from tests.unit.runtime.test_protocol import InProcess, Log
from tests.unit.runtime.test_stage_one import Noop, kafka_batch

PERSON = JsonSchema({"id": "long", "name": "string", "city": "string", "state": "string",
                     "date_time": "long", "extra": "string"})  # fmt: skip
AUCTION = JsonSchema({"id": "long", "seller": "long", "category": "long",
                      "item_name": "string", "date_time": "long"})  # fmt: skip
STATES = ("or", "id", "ca")


class Topics(Log):
    """The stand-in broker with several topics, each of its own partitions."""

    def __init__(self, partitions: dict[str, int]) -> None:
        self.values = {TopicPartition(t, p): [] for t, n in partitions.items() for p in range(n)}
        self.start = dict.fromkeys(self.values, 0)

    def send(self, topic: str, *values: bytes) -> None:
        """Round-robin over the topic's partitions."""
        logs = [v for tp, v in self.values.items() if tp.topic == topic]
        for i, value in enumerate(values):
            logs[i % len(logs)].append(value)


def person(i: int, **changed: Any) -> bytes:
    fields = {"id": i, "name": f"p{i}", "city": f"c{i % 5}", "state": STATES[i % 3] if i % 4
              else "wa", "date_time": 1000 + i, "extra": "x" * 40}  # fmt: skip
    return json.dumps({**fields, **changed}).encode()


def auction(i: int, **changed: Any) -> bytes:
    fields = {"id": 500 + i, "seller": i % 30, "category": 10 if i % 3 else 11,
              "item_name": f"item {i}", "date_time": 2000 + i}  # fmt: skip
    return json.dumps({**fields, **changed}).encode()


def suggest(a: dict[str, Any], p: dict[str, Any]) -> dict[str, Any]:
    return {"name": p["name"], "city": p["city"], "state": p["state"], "id": a["id"]}


def new_flow(root: Path) -> Dataflow:
    return Dataflow(
        "suggestions",
        checkpoints=str(root / "checkpoints"),
        event_time=EventTime("date_time", idle_timeout_s=None, watermark="global_max"),
        dead_letters=DeadLetterSink(path=str(root / "dead"), max_ratio=1.0),
        max_parallelism=16,
        parallelism=2,
    )


def q3(root: Path, columns: bool) -> Pipeline:
    """Nexmark q3's shape: auctions of category 10 ⋈ their sellers in three states."""
    flow = new_flow(root)
    auctions = flow.source(KafkaSource(topics=("auctions",), value_schema=AUCTION))
    people = flow.source(KafkaSource(topics=("people",), value_schema=PERSON))
    if columns:
        auctions = auctions.where(pc.field("category") == 10).select("id", "seller", "date_time")
        people = people.where(pc.field("state").isin(STATES)).select(
            "id", "name", "city", "state", "date_time"
        )
    else:
        auctions = auctions.filter(lambda a: a["category"] == 10)
        people = people.filter(lambda p: p["state"] in STATES)
    joined = auctions.key_by("seller").join(
        people.key_by("id"), TableJoin(select=suggest), uid="q3"
    )
    joined.to(ParquetSink("out", str(root / "out")))
    return flow.build()


def run(pipeline: Pipeline, log: Topics, batches: list[Callable[[], None]]) -> None:
    settings = dataclasses.replace(Settings.from_env(), spark_master="local[1]")
    for produce in batches:
        produce()
        BatchRunner(None, pipeline, settings, executor=InProcess(log), broker=log).run()


def outputs(root: Path) -> tuple[list[str], list[tuple[Any, ...]]]:
    rows = read_parquet_sink(str(root / "out")).to_pylist()
    dead = read_parquet_sink(str(root / "dead")).to_pylist()
    fields = ("reason", "error", "topic", "partition", "offset", "raw_value")
    return (sorted(json.dumps(r, sort_keys=True) for r in rows),
            sorted(tuple(d[f] for f in fields) for d in dead))  # fmt: skip


def test_a_join_of_sources_with_column_steps_equals_the_same_join_written_record_wise(
    tmp_path: Path,
) -> None:
    def batches(log: Topics) -> list[Callable[[], None]]:
        return [
            lambda: (log.send("people", *(person(i) for i in range(30))),
                     log.send("auctions", *(auction(i) for i in range(40)))),
            lambda: (log.send("auctions", *(auction(i) for i in range(40, 90)),
                              auction(90, seller=None), auction(91, category=None),
                              auction(92, date_time=5)),  # behind the watermark
                     log.send("people", person(30, state=7), person(31, city=None))),
        ]  # fmt: skip

    got = {}
    for columns in (True, False):
        root = tmp_path / str(columns)
        log = Topics({"auctions": 2, "people": 1})
        run(q3(root, columns), log, batches(log))
        got[columns] = outputs(root)

    rows, dead = got[True]
    assert rows == got[False][0]
    assert dead == got[False][1]

    def suggestion(i: int, seller: int) -> str:
        return json.dumps(suggest({"id": 500 + i}, json.loads(person(seller))), sort_keys=True)

    # auctions of category 10 (i % 3 != 0) whose seller is in one of STATES (seller % 4);
    # the table join takes a late auction (92) as any
    auctions = [*range(90), 92]
    reference = sorted(suggestion(i, i % 30) for i in auctions if i % 3 and i % 30 % 4)
    assert rows == reference
    named = sorted((d[2], d[1].split("'")[1], d[0]) for d in dead)  # the field's name
    assert named == [("auctions", "category", "schema_mismatch"),
                     ("auctions", "seller", "schema_mismatch"),
                     ("people", "city", "schema_mismatch"),
                     ("people", "state", "schema_mismatch")]  # fmt: skip
    assert sorted(json.loads(d[5])["id"] for d in dead) == [30, 31, 590, 591]  # the raw bytes


def q3_mapped(root: Path) -> Pipeline:
    """q3 with record-wise steps after each source's column steps: the seller renamed by
    a ``map`` (its key read from the new field), the people filtered once more."""
    flow = new_flow(root)
    auctions = flow.source(KafkaSource(topics=("auctions",), value_schema=AUCTION))
    people = flow.source(KafkaSource(topics=("people",), value_schema=PERSON))
    auctions = (
        auctions.where(pc.field("category") == 10)
        .select("id", "seller", "date_time")
        .map(lambda a: {"id": a["id"], "owner": a["seller"], "date_time": a["date_time"]})
    )
    people = people.where(pc.field("state").isin(STATES)).filter(lambda p: p["city"] != "c4")
    joined = auctions.key_by("owner").join(people.key_by("id"), TableJoin(select=suggest), uid="q3")
    joined.to(ParquetSink("out", str(root / "out")))
    return flow.build()


def test_record_wise_steps_after_each_sources_column_steps_give_the_record_wise_join(
    tmp_path: Path,
) -> None:
    got = {}
    for mapped in (True, False):
        root = tmp_path / str(mapped)
        log = Topics({"auctions": 2, "people": 1})
        pipeline = q3_mapped(root) if mapped else q3(root, columns=False)

        def produce(log: Topics = log) -> None:
            log.send("people", *(person(i) for i in range(30)), person(31, city=None))
            log.send("auctions", *(auction(i) for i in range(40)))

        run(pipeline, log, [produce])
        got[mapped] = outputs(root)

    rows, dead = got[True]
    kept = [r for r in got[False][0] if json.loads(r)["city"] != "c4"]
    assert rows == kept and 0 < len(kept) < len(got[False][0])
    assert [(d[0], d[2]) for d in dead] == [("schema_mismatch", "people")]  # city: null


def test_a_value_that_does_not_match_is_a_dead_letter_naming_the_field_with_its_bytes() -> None:
    pipeline = q3(Path("/tmp/unused"), columns=True)
    bad = auction(1, category="ten")
    values = [auction(0), bad, b"{not json", None, auction(4)]
    rows = StageOne(pipeline, parallelism=2, watermark=None).envelopes(
        _topic(kafka_batch(values), "auctions")
    )
    dead = {r["offset"]: DeadLetterDetail.from_payload(r["payload"])
            for r in rows.to_pylist() if r["kind"] == "dead_letter"}  # fmt: skip

    assert sorted(dead) == [101, 102, 103]
    assert dead[101].reason == "schema_mismatch"
    assert "'category'" in dead[101].error and dead[101].raw_value == bad
    assert dead[102].reason == "schema_mismatch" and dead[102].raw_value == b"{not json"
    assert dead[103].reason == "undecodable"  # a tombstone of a source without tombstones
    assert {(r["topic"], r["partition"]) for r in rows.to_pylist() if r["kind"] != "stat"} == {
        ("auctions", 1)
    }


def test_only_the_fields_the_column_steps_read_are_decoded_yet_every_field_is_checked() -> None:
    pipeline = q3(Path("/tmp/unused"), columns=True)
    # auctions: where reads category, select keeps id, seller, date_time; item_name: unread
    assert columns_read_by(pipeline) == {
        0: ("id", "seller", "category", "date_time"),
        1: ("id", "name", "city", "state", "date_time"),  # people's extra: unread
    }
    unread_bad = auction(1, item_name=7)
    rows = StageOne(pipeline, parallelism=2, watermark=None).envelopes(
        _topic(kafka_batch([auction(0), unread_bad, auction(2)]), "auctions")
    ).to_pylist()  # fmt: skip

    dead = [DeadLetterDetail.from_payload(r["payload"]) for r in rows if r["kind"] == "dead_letter"]
    assert [(d.reason, d.raw_value) for d in dead] == [("schema_mismatch", unread_bad)]
    assert "'item_name': expected string, got integer 7" in dead[0].error
    records = [decode_payload(r["payload"]) for r in rows if r["kind"] == "record"]
    assert records == [{"id": 502, "seller": 2, "date_time": 2002}]


def _topic(batch: Any, topic: str) -> Any:
    """``kafka_batch``'s rows, of ``topic``."""
    at = batch.schema.get_field_index("topic")
    return batch.set_column(at, "topic", pa.array([topic] * batch.num_rows))


def test_only_kept_rows_become_records_with_the_selected_fields_and_all_are_consumed() -> None:
    pipeline = q3(Path("/tmp/unused"), columns=True)
    values = [auction(i) for i in range(9)]  # category 10 unless i % 3 == 0
    rows = StageOne(pipeline, parallelism=2, watermark=None).envelopes(
        _topic(kafka_batch(values), "auctions")
    ).to_pylist()  # fmt: skip

    records = [r for r in rows if r["kind"] == "record"]
    assert [r["offset"] for r in records] == [101, 102, 104, 105, 107, 108]
    assert [decode_payload(r["payload"]) for r in records][:2] == [
        {"id": 501, "seller": 1, "date_time": 2001},
        {"id": 502, "seller": 2, "date_time": 2002},
    ]
    assert {r["topic"] for r in records} == {"auctions"}  # the join's first input
    stats = [partition_stats(r["payload"]) for r in rows if r["kind"] == "stat"]
    assert {(s.inputs, s.records, s.dead_letters) for s in stats} == {(9, 6, 0)}


def test_a_source_feeding_two_steps_is_keyed_for_each_after_its_column_steps() -> None:
    flow = new_flow(Path("/tmp/unused"))
    auctions = flow.source(KafkaSource(topics=("auctions",), value_schema=AUCTION)).where(
        pc.field("category") == 10
    )
    people = flow.source(KafkaSource(topics=("people",), value_schema=PERSON)).select(
        "id", "date_time"
    )
    by_seller = auctions.key_by("seller").process(Noop(), uid="sellers")
    by_seller.key_by("seller").join(auctions.key_by("id"), Noop(), uid="again")
    auctions.key_by("seller").join(people.key_by("id"), Noop(), uid="sides").to(
        ParquetSink("out", "/tmp/out")
    )
    pipeline = flow.build()
    rows = StageOne(pipeline, 2, None).envelopes(
        _topic(kafka_batch([auction(1), auction(3)]), "auctions")
    ).to_pylist()  # fmt: skip

    records = [(r["offset"], r["topic"]) for r in rows if r["kind"] == "record"]
    assert sorted(records) == [(100, "auctions"), (100, "auctions>again"),
                               (100, "auctions>sides")]  # fmt: skip


def several(auction_steps: Callable[[Stream], Stream], key: str = "seller") -> Pipeline:
    flow = new_flow(Path("/tmp/unused"))
    auctions = auction_steps(flow.source(KafkaSource(topics=("auctions",), value_schema=AUCTION)))
    people = flow.source(KafkaSource(topics=("people",), value_schema=PERSON))
    auctions.key_by(key).join(people.key_by("id"), Noop(), uid="q3").to(
        ParquetSink("out", "/tmp/out")
    )
    return flow.build()


@pytest.mark.parametrize(
    ("steps", "key", "error"),
    [
        (
            lambda s: s.select("id", "date_time"),
            "seller",
            r"select step 'source.select-1' of the source of \['auctions'\] drops column 'seller', "
            r"which key_by of step 'q3'",
        ),
        (
            lambda s: s.select("id", "seller").where(pc.field("id") > 1),
            "seller",
            r"'source.select-1' of the source of \['auctions'\] drops column 'date_time', which",
        ),
        (
            lambda s: s.select("id", "seller", "date_time").select("seller", "date_time"),
            "id",
            r"'source.select-2' of the source of \['auctions'\] drops column 'id', which key_by of",
        ),
        (
            lambda s: s.where(pc.field("id") > 1),
            "nope",
            r"'source.where-1' \(source of \['auctions'\]\): key_by of step 'q3' reads column "
            r"'nope', which the source's value_schema does not declare",
        ),
        (
            lambda s: s.where(pc.field("nope") == 1),
            "seller",
            r"where step 'source.where-1'.*no column 'nope'",
        ),
    ],
)
def test_what_cannot_work_is_refused_when_built_naming_step_and_column(
    steps: Any, key: str, error: str
) -> None:
    with pytest.raises(ConfigError, match=error):
        several(steps, key)


def test_a_source_read_through_different_column_steps_is_refused() -> None:
    flow = new_flow(Path("/tmp/unused"))
    auctions = flow.source(KafkaSource(topics=("auctions",), value_schema=AUCTION))
    people = flow.source(KafkaSource(topics=("people",), value_schema=PERSON))
    cheap = auctions.where(pc.field("category") == 10, name="tens")
    cheap.key_by("seller").join(people.key_by("id"), Noop(), uid="q3")
    auctions.key_by("id").process(Noop(), uid="all").to(ParquetSink("out", "/tmp/out"))

    with pytest.raises(ConfigError, match=r"different column steps \(where step 'tens'"):
        flow.build()


def test_a_source_without_a_declared_schema_refuses_column_steps() -> None:
    with pytest.raises(ConfigError, match=r"'source.where-1': column steps need the source's"):
        flow = new_flow(Path("/tmp/unused"))
        flow.source(KafkaSource(topics=("auctions",))).where(pc.field("id") > 1)


@pytest.mark.parametrize("columns", [True, False])
def test_one_source_feeding_two_steps_of_a_graph_reaches_both(columns: bool) -> None:
    flow = new_flow(Path("/tmp/unused"))
    auctions = flow.source(KafkaSource(topics=("auctions",), value_schema=AUCTION))
    if columns:
        auctions = auctions.where(pc.field("category") == 10).select("id", "seller", "date_time")
    else:
        auctions = auctions.filter(lambda a: a["category"] == 10)
    sellers = auctions.key_by("seller").process(Noop(), uid="sellers")
    auctions.key_by("id").join(sellers.key_by("id"), Noop(), uid="both").to(
        ParquetSink("out", "/tmp/out")
    )
    pipeline = flow.build()
    rows = StageOne(pipeline, 2, None).envelopes(
        _topic(kafka_batch([auction(1), auction(3)]), "auctions")
    ).to_pylist()  # fmt: skip

    records = sorted((r["offset"], r["topic"]) for r in rows if r["kind"] == "record")
    assert records == [(100, "auctions"), (100, "auctions>both")]
    payloads = [decode_payload(r["payload"]) for r in rows if r["kind"] == "record"]
    fields = ["date_time", "id", "seller"] if columns else sorted(AUCTION.fields)
    assert [sorted(p) for p in payloads] == [fields, fields]


def test_a_tombstone_of_a_table_side_with_column_steps_is_still_a_delete() -> None:
    flow = new_flow(Path("/tmp/unused"))
    auctions = flow.source(KafkaSource(topics=("auctions",), value_schema=AUCTION))
    table = KafkaSource(topics=("people",), value_schema=PERSON, tombstones=True, tombstone_key=int)
    people = flow.source(table).where(pc.field("state").isin(STATES))
    auctions.key_by("seller").join(people.key_by("id"), TableJoin(), uid="q3").to(
        ParquetSink("out", "/tmp/out")
    )
    batch = _topic(kafka_batch([person(1), None, person(4), None]), "people")
    keys = pa.array([None, b"7", None, None], pa.binary())
    batch = batch.set_column(batch.schema.get_field_index("key"), "key", keys)
    rows = StageOne(flow.build(), 2, None).envelopes(batch).to_pylist()

    records = {r["offset"]: decode_payload(r["payload"]) for r in rows if r["kind"] == "record"}
    assert records == {100: json.loads(person(1)), 101: None}  # person 4 is in "wa"
    dead = [(r["offset"], DeadLetterDetail.from_payload(r["payload"]).reason)
            for r in rows if r["kind"] == "dead_letter"]  # fmt: skip
    assert dead == [(103, "missing_key")]  # a tombstone without a Kafka key


def graph(identity_map: bool) -> Pipeline:
    """Auctions with column steps feeding two keyed steps, one that takes late records
    (a join) and one that does not; ``identity_map``: a ``map`` after the column steps,
    which sends every record down the per-record path."""
    flow = new_flow(Path("/tmp/unused"))
    schema = JsonSchema(AUCTION.fields, nullable=("id", "seller", "category", "date_time"))
    auctions = flow.source(KafkaSource(topics=("auctions",), value_schema=schema))
    auctions = auctions.where(pc.field("category") == 10).select("id", "seller", "date_time")
    if identity_map:
        auctions = auctions.map(lambda a: a)
    sellers = auctions.key_by("seller").process(Noop(), uid="sellers")
    auctions.key_by("id").join(sellers.key_by("id"), Noop(), uid="both").to(
        ParquetSink("out", "/tmp/out")
    )
    return flow.build()


def test_records_keyed_column_wise_are_the_rows_of_the_per_record_path() -> None:
    values = [auction(i) for i in range(40)] + [
        auction(40, seller=None),  # no key for one of its steps: the record is a dead letter
        auction(41, date_time=None),  # missing_event_time
        auction(43, id=None),  # no key for the other step
        auction(44, category=None),  # dropped by where: no row, no dead letter
        auction(46, date_time=5),  # late for "sellers" (the join would take it): dead letter
        auction(47, seller="s47"),  # schema_mismatch
    ]
    batch = _topic(kafka_batch(values), "auctions")

    def rows(pipeline: Pipeline) -> list[tuple[Any, ...]]:
        out = StageOne(pipeline, 2, watermark=1000).envelopes(batch).to_pylist()
        return sorted((tuple(r.values()) for r in out), key=repr)

    column_wise, per_record = rows(graph(False)), rows(graph(True))

    assert column_wise == per_record
    records = [r for r in column_wise if r[0] == "record"]
    kept = [i for i in range(40) if i % 3]
    assert sorted({r[3] - 100 for r in records}) == kept
    assert sorted(r[1] for r in records) == sorted(["auctions", "auctions>both"] * len(kept))
    dead = sorted((r[3] - 100, DeadLetterDetail.from_payload(r[9]).reason)
                  for r in column_wise if r[0] == "dead_letter")  # fmt: skip
    assert dead == [(40, "missing_key"), (41, "missing_event_time"), (42, "missing_key"),
                    (44, "late"), (45, "schema_mismatch")]  # fmt: skip
