"""Records as columns: stage 1 with a declared schema gives the rows the per-record path
gives, dead letters name the field; stage 2 builds a key's records only when read."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pytest

from microbatch.runtime import DeadLetterSink, EventTime, KafkaSource, Pipeline
from microbatch.runtime.columnar import LazyRecords
from microbatch.runtime.envelope import DeadLetterDetail
from microbatch.runtime.schema import JsonSchema
from microbatch.runtime.stage_one import StageOne
from tests.unit.runtime.test_stage_one import Noop, kafka_batch

SCHEMA = JsonSchema({"user": "string", "ts": "long", "page": "string"}, nullable=("page",))
PLAIN = Pipeline(
    name="p",
    source=KafkaSource(topics=("t",)),
    key_by="user",
    process=Noop(),
    checkpoints="/tmp/x",
    dead_letters=DeadLetterSink(path="/tmp/dl"),
    event_time=EventTime(field="ts"),
    max_parallelism=16,
    parallelism=3,
)
DECLARED = dataclasses.replace(
    PLAIN, source=KafkaSource(topics=("t",), value_schema=SCHEMA)
)  # fmt: skip
ROUTING = ("kind", "topic", "partition", "offset", "seq", "instance", "key_group", "key",
           "event_ts")  # fmt: skip


def click(**fields: Any) -> bytes:
    return json.dumps(fields).encode()


def envelopes(pipeline: Pipeline, values: list[bytes | None], watermark: int | None = None):
    out = StageOne(pipeline, parallelism=3, watermark=watermark).envelopes(kafka_batch(values))
    return sorted(out.to_pylist(), key=lambda r: (r["kind"], r["offset"], r["instance"]))


def test_good_records_are_routed_as_the_per_record_path_routes_them() -> None:
    values = [click(user=f"u{i % 5}", ts=1000 + i, page=f"/p{i}") for i in range(30)]

    plain, declared = envelopes(PLAIN, values), envelopes(DECLARED, values)

    assert [{c: r[c] for c in ROUTING} for r in declared] == [
        {c: r[c] for c in ROUTING} for r in plain
    ]
    records = [r for r in declared if r["kind"] == "record"]
    assert [r["value_page"] for r in records] == [f"/p{i}" for i in range(30)]
    assert {r["payload"] for r in records} == {None}  # the columns are the record
    stats = [r for r in declared if r["kind"] == "stat"]
    assert [r["payload"] for r in stats] == [r["payload"] for r in plain if r["kind"] == "stat"]


def test_bad_values_are_dead_letters_naming_the_field_and_keep_their_bytes() -> None:
    values = [
        click(user="a", ts=5000),  # good (page is nullable)
        click(user="a", ts="5000"),  # wrong type
        click(user="a"),  # missing field
        b"{not json",
        None,  # a tombstone
        click(user=None, ts=5000),  # null in a non-nullable field
        click(user="b", ts=10),  # late
        click(user="c", ts=6000, page=7),  # wrong type in a nullable field: not a null
    ]

    rows = envelopes(DECLARED, values, watermark=1000)

    records = [(r["offset"], r["key"]) for r in rows if r["kind"] == "record"]
    assert records == [(100, b"sa")]
    dead = {
        r["offset"]: DeadLetterDetail.from_payload(r["payload"])
        for r in rows
        if r["kind"] == "dead_letter"
    }
    reasons = {off: (d.reason, d.error) for off, d in dead.items()}
    mismatch = "schema_mismatch"
    assert reasons[101] == (mismatch, "field 'ts': expected long, got string \"5000\"")
    assert reasons[102] == (mismatch, "field 'ts' is missing (declared long, not nullable)")
    assert reasons[103][0] == mismatch and "value is not JSON" in reasons[103][1]
    assert reasons[104] == ("undecodable", "record has no value (tombstone)")
    assert reasons[105] == (mismatch, "field 'user' is null (declared string, not nullable)")
    assert reasons[106][0] == "late" and "behind the watermark 1000" in reasons[106][1]
    assert reasons[107] == (mismatch, "field 'page': expected string, got integer 7")
    assert dead[101].raw_value == values[1]


def test_a_nullable_key_or_event_time_that_is_null_is_the_per_record_dead_letter() -> None:
    schema = JsonSchema({"user": "string", "ts": "string"}, nullable=("user", "ts"))
    pipe = dataclasses.replace(PLAIN, source=KafkaSource(topics=("t",), value_schema=schema))
    values = [click(user=None, ts="2026-01-01T00:00:01Z"), click(user="a"),
              click(user="a", ts="2026-01-01T00:00:01Z"), click(user="b", ts="nope")]  # fmt: skip

    rows, plain = envelopes(pipe, values), envelopes(PLAIN, values)

    def routed(rs: list[dict[str, Any]]) -> list[Any]:
        def why(r: dict[str, Any]) -> Any:
            dead = r["kind"] == "dead_letter"
            return DeadLetterDetail.from_payload(r["payload"])[:2] if dead else None

        rs = sorted((r for r in rs if r["kind"] != "stat"), key=lambda r: r["offset"])
        return [(r["offset"], r["kind"], r["key"], r["event_ts"], why(r)) for r in rs]

    assert routed(rows) == routed(plain)
    assert [r[1] for r in routed(rows)] == ["dead_letter", "dead_letter", "record", "dead_letter"]


def test_integer_keys_are_keyed_as_the_per_record_path_keys_them() -> None:
    schema = JsonSchema({"user": "long", "ts": "long"})
    pipe = dataclasses.replace(PLAIN, source=KafkaSource(topics=("t",), value_schema=schema))
    values = [click(user=i % 4 - 2, ts=i) for i in range(12)]

    got = [{c: r[c] for c in ROUTING} for r in envelopes(pipe, values)]

    assert got == [{c: r[c] for c in ROUTING} for r in envelopes(PLAIN, values)]


def test_enriched_pipelines_check_the_schema_record_by_record() -> None:
    stage = StageOne(DECLARED, parallelism=3, watermark=None)

    assert stage.decode(click(user="a", ts=1, extra=1)) == {"user": "a", "ts": 1, "page": None}
    try:
        stage.decode(click(user="a", ts=1.5))
    except Exception as e:
        assert (type(e).__name__, e.reason, e.error) == (  # type: ignore[attr-defined]
            "_Bad", "schema_mismatch", "field 'ts': expected long, got number 1.5"
        )  # fmt: skip
    else:
        raise AssertionError("a wrong type passed")


def test_lazy_records_build_dicts_only_when_read() -> None:
    table = pa.table({"user": ["a", "a", "b"], "n": [1, 2, 3]})
    records = LazyRecords(table, pa.array([1, 2]))

    assert len(records) == 2 and records._built is None
    assert records.record(1) == {"user": "b", "n": 3} and records._built is None
    assert records == [{"user": "a", "n": 2}, {"user": "b", "n": 3}]
    assert records[-1] == {"user": "b", "n": 3} and [r["n"] for r in records] == [2, 3]
    assert pc.sum(records.columns().column("n")).as_py() == 5


def test_decoded_records_columns_hold_every_field_not_only_the_first_records() -> None:
    """Windows over payload records read these columns: when an instance's first record
    lacked the summed field, the column was missing and every retry of the batch failed
    (``No match for FieldRef.Name(amount)``)."""
    from microbatch.runtime.columnar import DecodedRecords
    from microbatch.windows import Count, Sum, Tumbling
    from microbatch.windows.aggregate import KEY, ORDER, TS
    from microbatch.windows.operator import WindowOperator

    records = DecodedRecords(
        [{"user": "a", "ts": 0}, {"user": "a", "ts": 1, "amount": 5, "page": "/x"}]
    )
    columns = records.columns()
    assert columns.column_names == ["user", "ts", "amount", "page"]
    assert columns.column("amount").to_pylist() == [None, 5]

    table = columns.append_column(KEY, pa.array(["a", "a"]))
    table = table.append_column(TS, columns.column("ts")).append_column(ORDER, pa.array([0, 1]))
    op = WindowOperator(Tumbling("1m"), (Count("n"), Sum("total", "amount")))
    rows = op.run(table, {}, None, 10**12).rows
    assert rows == [{"key": "a", "window_start": 0, "window_end": 60_000, "n": 2, "total": 5}]


def test_records_give_the_columns_of_only_the_fields_asked_for() -> None:
    """A window reads a field or two; building every field of the records as columns
    cost about as much as the window. A field no record has is a column of nulls."""
    from microbatch.runtime.columnar import DecodedRecords

    records = DecodedRecords([{"user": "a", "ts": 0, "page": "/x"}, {"user": "a", "ts": 1}])
    columns = records.columns({"amount", "page"})
    assert sorted(columns.column_names) == ["amount", "page"]
    assert columns.column("page").to_pylist() == ["/x", None]
    assert columns.column("amount").null_count == 2

    lazy = LazyRecords(pa.table({"user": ["a", "b"], "n": [1, 2]}), pa.array([1]))
    assert lazy.columns({"n", "absent"}).to_pydict() == {"n": [2]}


def test_known_keys_give_each_key_its_own_bytes_and_group_across_batches() -> None:
    from microbatch.keygroups import encode_key, key_group_of_bytes
    from microbatch.runtime.columnar import KnownKeys

    known = KnownKeys(max_parallelism=128)
    batches = [["a", "b", "c"], ["c", "d", "a"], ["e"], ["b", "e", "f", "a"]]
    for keys in batches:
        kbs, kgs = known.lookup(pa.array(keys))

        expected = [encode_key(k) for k in keys]
        assert kbs.to_pylist() == expected, keys
        assert kgs.tolist() == [key_group_of_bytes(kb, 128) for kb in expected], keys
    assert known.keys is not None and sorted(known.keys.to_pylist()) == list("abcdef")


def test_known_keys_start_over_past_their_limit_and_keep_integer_keys_exact() -> None:
    from microbatch.keygroups import encode_key
    from microbatch.runtime.columnar import KnownKeys

    known = KnownKeys(max_parallelism=16)
    known.LIMIT = 4
    known.lookup(pa.array([1, 2, 3], pa.int64()))
    kbs, _ = known.lookup(pa.array([3, -2, 7], pa.int64()))  # 6 > 4: forgets 1, 2

    assert kbs.to_pylist() == [encode_key(3), encode_key(-2), encode_key(7)]
    assert known.keys is not None and known.keys.to_pylist() == [3, -2, 7]
    assert not KnownKeys.takes(pa.float64()) and not KnownKeys.takes(pa.bool_())


def test_row_dicts_give_each_key_its_rows_whatever_the_order_of_reads() -> None:
    from microbatch.runtime.columnar import RowDicts

    table = pa.table({"user": [f"u{i % 7}" for i in range(500)], "n": list(range(500))})
    rows = pc.sort_indices(table, [("user", "ascending"), ("n", "ascending")])
    every = table.take(rows).to_pylist()
    ranges = [(i, min(i + 1 + i % 5, 500)) for i in range(0, 500, 6)]
    for order in (ranges, ranges[::-1], ranges[::3] + ranges[1::3]):
        built = RowDicts(table, rows)
        for i, j in order:
            assert built.between(i, j) == every[i:j], (i, j)


def test_row_dicts_build_ahead_only_while_keys_are_read_one_after_another() -> None:
    from microbatch.runtime.columnar import RowDicts

    table = pa.table({"n": list(range(100_000))})
    rows = pa.array(range(100_000))
    sequential = RowDicts(table, rows)
    for i in range(0, 20_000, 10):  # every key of 10 rows, in order
        sequential.between(i, i + 10)
    assert sequential._run == RowDicts.MOST and len(sequential._built) == RowDicts.MOST

    sparse = RowDicts(table, rows)
    for i in range(0, 100_000, 5_000):  # a key here and there
        assert sparse.between(i, i + 3) == [{"n": i}, {"n": i + 1}, {"n": i + 2}]
        assert len(sparse._built) == RowDicts.LEAST  # its rows and a few after


@pytest.mark.parametrize(
    "key_type", [pa.int64(), pa.int32(), pa.uint64()], ids=["int64", "int32", "uint64"]
)
def test_known_int_keys_encoded_at_once_equal_each_key_encoded_alone(key_type) -> None:
    """New int keys are encoded and hashed as a column (uint64 past 2**62: one by one)."""
    from microbatch.keygroups import encode_key, key_group_of_bytes
    from microbatch.runtime.columnar import KnownKeys

    big = 2**63 + 5 if key_type == pa.uint64() else 2**31 - 1
    low = 0 if key_type == pa.uint64() else -(2**31)
    known = KnownKeys(max_parallelism=128)
    batches = [[1, 300, 70_000], [300, big, 2, low], [2, 1, 9, big, 65_536]]
    for keys in batches:
        kbs, kgs = known.lookup(pa.array(keys, key_type))

        expected = [encode_key(k) for k in keys]
        assert kbs.to_pylist() == expected, keys
        assert kgs.tolist() == [key_group_of_bytes(kb, 128) for kb in expected], keys
