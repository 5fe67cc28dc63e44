"""Column-wise steps (``where``/``select``): stage 1 runs them on the decoded columns and
gives the rows a record-wise filter and map give; dead letters stay what they were; what
cannot work is refused when the dataflow is built, naming the step and the column."""

from __future__ import annotations

import json
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pytest

from microbatch.dataflow import Dataflow, Stream
from microbatch.errors import ConfigError, ProcessError
from microbatch.runtime import DeadLetterSink, EventTime, JsonSchema, KafkaSource, ParquetSink
from microbatch.runtime.column_plan import columnar_values
from microbatch.runtime.columnar import batch_records
from microbatch.runtime.columns import ColumnStep, columns_read
from microbatch.runtime.decoding import event_time_ms
from microbatch.runtime.envelope import DeadLetterDetail, partition_stats
from microbatch.runtime.pipeline import Pipeline
from microbatch.runtime.sorted_records import SortedRecords
from microbatch.runtime.stage_one import StageOne
from tests.unit.runtime.test_stage_one import Noop, kafka_batch

SCHEMA = JsonSchema({"auction": "long", "bidder": "string", "price": "long", "ts": "long"},
                    nullable=("bidder",))  # fmt: skip
ROUTING = ("kind", "topic", "partition", "offset", "instance", "key_group", "key", "event_ts")


def bid(**fields: Any) -> bytes:
    return json.dumps(fields).encode()


def build(
    steps: Any, schema: JsonSchema | None = SCHEMA, key: str = "auction", **settings: Any
) -> Pipeline:
    flow = Dataflow(
        "bids",
        checkpoints="/tmp/x",
        event_time=EventTime(field="ts"),
        dead_letters=DeadLetterSink(path="/tmp/dl"),
        max_parallelism=16,
        parallelism=3,
        **settings,
    )
    stream: Stream = steps(flow.source(KafkaSource(topics=("t",), value_schema=schema)))
    stream.key_by(key).process(Noop(), uid="noop").to(ParquetSink("out", "/tmp/out"))
    return flow.build()


COLUMNS = build(
    lambda s: s.where(pc.field("price") > 10).select(
        "auction", "ts", "bidder", euros=pc.field("price") * 0.5
    )
)
RECORDS = build(
    lambda s: s.filter(lambda b: b["price"] > 10).map(
        lambda b: {
            "auction": b["auction"],
            "ts": b["ts"],
            "bidder": b["bidder"],
            "euros": b["price"] * 0.5,
        }
    ),
    schema=None,
)


def envelopes(pipeline: Pipeline, values: list[bytes | None], watermark: int | None = None):
    out = StageOne(pipeline, parallelism=3, watermark=watermark).envelopes(kafka_batch(values))
    return sorted(out.to_pylist(), key=lambda r: (r["kind"], r["offset"], r["instance"]))


def test_where_and_select_give_the_rows_of_a_record_wise_filter_and_map() -> None:
    values = [bid(auction=i % 7, bidder=f"b{i}", price=i, ts=1000 + i) for i in range(40)]

    columns, records = envelopes(COLUMNS, values), envelopes(RECORDS, values)

    assert columnar_values(COLUMNS).names == ["auction", "ts", "bidder", "euros"]
    assert [{c: r[c] for c in ROUTING} for r in columns] == [
        {c: r[c] for c in ROUTING} for r in records
    ]
    kept = [r for r in columns if r["kind"] == "record"]
    assert [r["offset"] for r in kept] == [100 + i for i in range(11, 40)]
    assert [r["value_euros"] for r in kept] == [i * 0.5 for i in range(11, 40)]
    assert {r["payload"] for r in kept} == {None}  # still columns
    # Dropped rows are consumed input, as after a record-wise filter.
    stats = [partition_stats(r["payload"]) for r in columns if r["kind"] == "stat"]
    assert {(s.inputs, s.records, s.dead_letters) for s in stats} == {(40, 29, 0)}


def where(condition: pc.Expression) -> ColumnStep:
    return ColumnStep("where", "w", condition=condition)


def select(*names: str, **computed: pc.Expression) -> ColumnStep:
    return ColumnStep("select", "s", names=names, computed=tuple(computed.items()))


@pytest.mark.parametrize(
    ("steps", "read"),
    [
        ((), ("auction", "bidder", "price", "ts")),  # the records hold every field
        ((where(pc.field("price") > 10),), ("auction", "bidder", "price", "ts")),
        ((where(pc.field("price") > 10), select("auction")), ("auction", "price")),
        ((select("ts", euros=pc.field("price") * 0.5),), ("price", "ts")),
        ((select("ts"), where(pc.field("ts") > 0)), ("ts",)),
        ((select(one=pc.scalar(1)),), ("ts",)),  # reads none: one column keeps the rows
    ],
)
def test_the_columns_steps_read_are_those_they_need_to_give_their_output(steps, read) -> None:
    """Stage 1 decodes only these (and still checks every declared field)."""
    assert columns_read(steps, SCHEMA.arrow_schema) == read


def test_stage_two_records_have_the_projected_fields() -> None:
    values = [bid(auction=1, bidder="x", price=20 + i, ts=5) for i in range(3)]
    rows = StageOne(COLUMNS, 3, None).envelopes(kafka_batch(values))
    recs = SortedRecords(pa.Table.from_batches([rows]))
    records = list(batch_records(COLUMNS, recs)(0, recs.num_rows))

    assert records == [{"auction": 1, "ts": 5, "bidder": "x", "euros": (20 + i) * 0.5}
                       for i in range(3)]  # fmt: skip


def test_dead_letters_are_those_of_today_and_where_runs_before_keying() -> None:
    values = [
        bid(auction=1, price="x", ts=5),  # schema mismatch: a dead letter, where or not
        None,  # a tombstone: a dead letter
        bid(auction=1, price=50, ts=10),  # late and kept: a dead letter
        bid(auction=1, price=5, ts=10),  # late but dropped by where: consumed, no dead letter
        bid(auction=1, price=60, ts=5000),  # good
    ]
    rows = envelopes(COLUMNS, values, watermark=1000)

    assert dead_letters(rows) == {100: "schema_mismatch", 101: "undecodable", 102: "late"}
    assert [r["offset"] for r in rows if r["kind"] == "record"] == [104]


def test_a_key_computed_as_null_is_a_missing_key_dead_letter_unless_where_drops_it() -> None:
    pipeline = build(
        lambda s: s.where(pc.field("price") > 1).select("ts", auction=pc.field("bidder"))
    )
    values = [
        bid(auction=1, price=5, ts=5000),  # kept, no bidder: no key
        bid(auction=1, price=0, ts=5000),  # no bidder either, but dropped first
        bid(auction=1, bidder="k", price=5, ts=5000),
    ]
    rows = envelopes(pipeline, values)

    assert dead_letters(rows) == {100: "missing_key"}
    assert [r["value_auction"] for r in rows if r["kind"] == "record"] == ["k"]


def dead_letters(rows: list[dict[str, Any]]) -> dict[int, str]:
    return {
        r["offset"]: DeadLetterDetail.from_payload(r["payload"]).reason
        for r in rows
        if r["kind"] == "dead_letter"
    }


def test_a_null_condition_drops_the_row() -> None:
    pipeline = build(lambda s: s.where(pc.field("bidder") == "b"))
    values = [bid(auction=1, bidder="b", price=1, ts=5), bid(auction=2, price=1, ts=5),
              bid(auction=3, bidder="c", price=1, ts=5)]  # fmt: skip

    rows = envelopes(pipeline, values)

    assert [r["value_auction"] for r in rows if r["kind"] == "record"] == [1]
    assert not [r for r in rows if r["kind"] == "dead_letter"]


def test_an_arrow_error_at_run_time_fails_the_batch_naming_step_and_partition() -> None:
    pipeline = build(lambda s: s.select("auction", "ts", big=pc.field("price") * 4))
    values = [bid(auction=1, price=2**62, ts=5)]

    with pytest.raises(ProcessError, match=r"'bids'.*'source.select-1'.*overflow.*t\[1\]"):
        envelopes(pipeline, values)


@pytest.mark.parametrize(
    ("steps", "error"),
    [
        (lambda s: s.where(pc.field("nope") > 1), r"where step 'source.where-1'.*no column 'nope'"),
        (lambda s: s.select("auction", "nope"), r"select step 'source.select-1': no column 'nope'"),
        (
            lambda s: s.where(pc.field("price") + 1),
            r"'source.where-1' must give a boolean, not int64",
        ),
        (lambda s: s.select(x=pc.field("bidder") + 1), r"'source.select-1' does not evaluate.*add"),
        (lambda s: s.select("price").select("auction"), r"'source.select-2': no column 'auction'"),
        (lambda s: s.where(lambda b: True), r"where\(\) takes a pyarrow.compute.Expression"),
        (lambda s: s.select(x=3), r"select\(\) column 'x' must be a pyarrow.compute.Expression"),
        (
            lambda s: s.filter(lambda b: True).where(pc.field("price") > 1),
            r"'source.where-1': comes after the record-wise step 'source.filter-1'",
        ),
        (
            lambda s: s.key_by("auction").process(Noop(), uid="a").where(pc.field("x") > 1),
            r"not after a keyed step",
        ),
        (
            lambda s: s.select("price"),
            r"key_by 'auction' is not a field.*after the column steps: price",
        ),
    ],
)
def test_what_cannot_work_is_refused_when_built(steps: Any, error: str) -> None:
    with pytest.raises(ConfigError, match=error):
        build(steps)


def test_column_steps_need_a_declared_schema() -> None:
    with pytest.raises(ConfigError, match=r"'source.where-1': column steps need the source's"):
        build(lambda s: s.where(pc.field("price") > 1), schema=None)


def test_a_sink_after_column_steps_in_a_dataflow_with_keyed_steps_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"sink 'early' after column steps: in a dataflow with"):
        build(lambda s: s.where(pc.field("price") > 1).to(ParquetSink("early", "/tmp/early")))


# Record-wise steps after column steps: the columns kept become records, then map/filter.

WHERE_THEN_MAP = build(
    lambda s: (
        s.where(pc.field("price") > 10)
        .select("auction", "ts", "price")
        .map(lambda b: {**b, "euros": b["price"] * 0.5})
        .filter(lambda b: b["auction"] != 3)
    )
)
FILTER_THEN_MAP = build(
    lambda s: (
        s.filter(lambda b: b["price"] > 10)
        .map(lambda b: {"auction": b["auction"], "ts": b["ts"], "price": b["price"]})
        .map(lambda b: {**b, "euros": b["price"] * 0.5})
        .filter(lambda b: b["auction"] != 3)
    ),
    schema=None,
)


def stage_two_records(pipeline: Pipeline, values: list[bytes | None]) -> list[Any]:
    rows = StageOne(pipeline, 3, None).envelopes(kafka_batch(values))
    recs = SortedRecords(pa.Table.from_batches([rows]).filter(pc.field("kind") == "record"))
    return list(batch_records(pipeline, recs)(0, recs.num_rows))


def test_map_and_filter_after_column_steps_give_what_they_give_on_records() -> None:
    values = [bid(auction=i % 7, bidder=f"b{i}", price=i, ts=1000 + i) for i in range(40)]

    columns, records = envelopes(WHERE_THEN_MAP, values), envelopes(FILTER_THEN_MAP, values)

    assert columnar_values(WHERE_THEN_MAP) is None  # records travel as payloads
    assert [{c: r[c] for c in ROUTING} for r in columns] == [
        {c: r[c] for c in ROUTING} for r in records
    ]
    kept = [r["offset"] for r in columns if r["kind"] == "record"]
    assert kept == [100 + i for i in range(11, 40) if i % 7 != 3]
    expected = stage_two_records(FILTER_THEN_MAP, values)
    assert stage_two_records(WHERE_THEN_MAP, values) == expected
    assert expected[0] == {"auction": 0, "ts": 1014, "price": 14, "euros": 7.0}


def test_a_map_after_column_steps_that_raises_is_a_dead_letter_with_the_source_bytes() -> None:
    pipeline = build(
        lambda s: s.where(pc.field("price") > 1).map(lambda b: {**b, "r": 100 // b["auction"]}),
        on_process_error="dead_letter",
    )
    values = [bid(auction=0, price=5, ts=5), bid(auction=1, price="x", ts=5),
              bid(auction=2, price=5, ts=5)]  # fmt: skip

    rows = envelopes(pipeline, values)

    assert dead_letters(rows) == {100: "step_failed", 101: "schema_mismatch"}
    detail = next(DeadLetterDetail.from_payload(r["payload"]) for r in rows
                  if r["kind"] == "dead_letter" and r["offset"] == 100)  # fmt: skip
    assert "source.map-1" in detail.error and detail.raw_value == values[0]
    assert stage_two_records(pipeline, values) == [{"auction": 2, "bidder": None, "price": 5,
                                                    "ts": 5, "r": 50}]  # fmt: skip


def test_a_key_a_map_makes_after_a_select_dropped_it_is_not_refused() -> None:
    pipeline = build(
        lambda s: s.select("price", "ts").map(lambda b: {**b, "auction": b["price"] % 3})
    )
    values = [bid(auction=9, price=p, ts=5) for p in (4, 5)]

    assert [r["auction"] for r in stage_two_records(pipeline, values)] == [1, 2]


def test_record_wise_steps_after_column_steps_before_a_sink_without_keyed_steps_are_refused():
    flow = Dataflow("bids", checkpoints="/tmp/x")
    source = flow.source(KafkaSource(topics=("t",), value_schema=SCHEMA))
    source.where(pc.field("price") > 1).map(lambda b: b).to(ParquetSink("out", "/tmp/out"))

    with pytest.raises(ConfigError, match=r"sink 'out': map/filter/flat_map after where/select"):
        flow.build()


def test_a_filter_after_column_steps_hands_on_the_selected_record_not_the_source_bytes():
    pipeline = build(lambda s: s.select("auction", "ts").filter(lambda b: b["auction"] > 1))
    values = [bid(auction=a, bidder="b", price=1, ts=5) for a in (1, 2)]

    assert stage_two_records(pipeline, values) == [{"auction": 2, "ts": 5}]


def test_a_computed_event_time_that_is_not_finite_is_a_bad_event_time_dead_letter() -> None:
    # price 2: 2e301, beyond int64; 10: inf; -10: -inf
    huge = pc.power(pc.field("price").cast(pa.float64()), 1001.0)
    pipeline = build(lambda s: s.select("auction", ts=pc.field("ts").cast(pa.float64()) + huge))
    prices = ((0, 5000), (2, 5000), (10, 0), (-10, 0), (1, 8000))
    values = [bid(auction=1, price=p, ts=t) for p, t in prices]

    rows = envelopes(pipeline, values)

    assert dead_letters(rows) == {101: "bad_event_time", 102: "bad_event_time",
                                  103: "bad_event_time"}  # fmt: skip
    assert [r["event_ts"] for r in rows if r["kind"] == "record"] == [5000, 8001]


def test_an_event_time_out_of_int64s_range_is_not_an_epoch_ms() -> None:
    with pytest.raises(ValueError, match="out of range"):
        event_time_ms(2**63)
    assert event_time_ms(2**63 - 1) == 2**63 - 1
    assert event_time_ms(-(2**63)) == -(2**63)
