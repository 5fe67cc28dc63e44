"""Declared value schemas: the type, its decoding in Arrow against the per-record
reference, and the pipelines' checks at build time."""

from __future__ import annotations

import json

import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from microbatch.errors import ConfigError
from microbatch.runtime import EventTime, KafkaSource, KeyedProcessFunction, Pipeline
from microbatch.runtime import schema as schema_module
from microbatch.runtime.schema import JsonSchema, SchemaMismatch

SCHEMA = JsonSchema(
    {"user_id": "string", "ts": "long", "amount": "double", "n": "int", "ok": "boolean"},
    nullable=("amount", "ok"),
)
GOOD = {"user_id": "u1", "ts": 1_000, "amount": 2.5, "n": 3, "ok": True}


class Noop(KeyedProcessFunction):
    def process(self, key, records, ctx) -> None:
        pass


def value(**changes: object) -> bytes:
    record = {**GOOD, **changes}
    return json.dumps({k: v for k, v in record.items() if v is not ...}).encode()


#: (value, the field the error must name or None, words the error must contain)
BAD = [
    (value(ts="soon"), "ts", 'expected long, got string "soon"'),
    (value(ts=1.5), "ts", "expected long, got number 1.5"),
    (value(ts=True), "ts", "expected long, got boolean"),
    (value(user_id=42), "user_id", "expected string, got integer 42"),
    (value(user_id={"a": 1}), "user_id", "expected string, got object"),
    (value(n=2**31), "n", "expected int, got integer 2147483648"),
    (value(amount="1.5"), "amount", 'expected double, got string "1.5"'),
    (value(ok=1), "ok", "expected boolean, got integer 1"),
    (value(ts=...), "ts", "field 'ts' is missing"),
    (value(user_id=None), "user_id", "field 'user_id' is null"),
    (b"{not json", None, "value is not JSON"),
    (b"", None, "value is not JSON"),
    (b"[1, 2]", None, "value is a JSON array, not an object"),
    (b"42", None, "value is a JSON integer, not an object"),
    (b'{"user_id": "\xff"}', None, "value is not UTF-8"),
    (value() + b" " + value(), None, "value is not JSON: Extra data"),
    (b'{"user_id": "a\\ud800", "ts": 1, "n": 1}', "user_id", "a lone UTF-16 surrogate"),
]


def test_a_schema_has_an_arrow_schema_and_a_spark_ddl() -> None:
    assert SCHEMA.arrow_schema == pa.schema(
        [
            pa.field("user_id", pa.string(), nullable=False),
            pa.field("ts", pa.int64(), nullable=False),
            pa.field("amount", pa.float64()),
            pa.field("n", pa.int32(), nullable=False),
            pa.field("ok", pa.bool_()),
        ]
    )
    assert SCHEMA.spark_ddl == (
        "`user_id` STRING NOT NULL, `ts` BIGINT NOT NULL, `amount` DOUBLE, `n` INT NOT NULL, "
        "`ok` BOOLEAN"
    )
    assert JsonSchema.from_arrow(SCHEMA.arrow_schema) == SCHEMA
    assert JsonSchema({"a": "BIGINT", "b": "bool"}).fields == {"a": "long", "b": "boolean"}


@pytest.mark.parametrize(
    ("fields", "nullable", "message"),
    [
        ({"a": "decimal"}, (), "field 'a' has unknown type 'decimal'"),
        ({}, (), "declares no field"),
        ({"a": "string"}, ("b",), "nullable names fields it does not declare: ['b']"),
        (pa.schema([("a", pa.string())]), (), "JsonSchema.from_arrow"),
    ],
)
def test_a_schema_that_cannot_work_is_refused(fields, nullable, message) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace("[", r"\[")):
        JsonSchema(fields, nullable)


def test_the_reference_decodes_declared_fields_only_and_nullable_ones_as_none() -> None:
    raw = json.dumps({"user_id": "u", "ts": 5, "n": 1, "amount": 3, "extra": [1]}).encode()

    assert SCHEMA.decode_record(raw) == {
        "user_id": "u", "ts": 5, "amount": 3.0, "n": 1, "ok": None,
    }  # fmt: skip


@pytest.mark.parametrize(("raw", "field", "words"), BAD)
def test_each_bad_value_is_a_mismatch_that_names_the_field(raw, field, words) -> None:
    with pytest.raises(SchemaMismatch) as caught:
        SCHEMA.decode_record(raw)
    assert caught.value.field == field
    assert words in str(caught.value)
    if field is not None:
        assert repr(field) in str(caught.value)


def reference(values: list[bytes]) -> tuple[list, list]:
    """(position, record) of every value the per-record reference takes, and (position,
    error) of every one it refuses."""
    rows, bad = [], []
    for i, raw in enumerate(values):
        try:
            rows.append((i, SCHEMA.decode_record(raw)))
        except SchemaMismatch as e:
            bad.append((i, str(e)))
    return rows, bad


@pytest.fixture(params=["native", "arrow"])
def decoder(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each decoding test runs with the native fast path and without it (pyarrow.json and
    Python alone, as on a machine without the extension)."""
    if request.param == "native":
        assert schema_module._native_decoder() is not None, "microbatch_native is missing"
    else:
        monkeypatch.setattr(schema_module, "_native_decoder", lambda: None)
    return request.param


def test_arrow_decoding_equals_the_reference_value_by_value_however_split(decoder) -> None:
    good = [value(user_id=f"u{i}", ts=i, amount=i / 2 if i % 3 else None) for i in range(40)]
    odd = [
        value(ok=...),  # a nullable field missing
        b'{"user_id": "x",\n "ts": 1, "n": 2}',  # a line break inside: parsed alone
        b'{"user_id": "r",\r "ts": 2, "n": 3}',  # a carriage return: likewise
        b'{"user_id": "t",\t"ts": 3, "n": 4}',  # a tab is no line break: parsed in its block
        b'{"ts": -0, "user_id": "neg", "n": 0}',  # Arrow refuses -0; Python takes it
        b'{"user_id": "d", "user_id": "e", "ts": 1, "n": 1}',  # duplicate: the last wins
    ]
    values = [*good[:10], *[b for b, _, _ in BAD], *good[10:20], *odd, *good[20:]]

    expected_rows, expected_bad = reference(values)
    for size in (len(values), 7, 1):
        rows, bad = [], []
        for start in range(0, len(values), size):
            chunk = pa.array(values[start : start + size], pa.binary())
            decoded = SCHEMA.decode(chunk)
            assert decoded.table.schema == SCHEMA.arrow_schema
            got = decoded.table.to_pylist()
            rows += [(start + int(r), g) for r, g in zip(decoded.rows, got, strict=True)]
            bad += [(start + r, e) for r, e in decoded.bad]
        assert rows == expected_rows
        assert bad == expected_bad


@pytest.mark.parametrize("keep", [("ts",), ("n", "user_id"), ("amount", "ok")])
def test_decoding_some_fields_checks_them_all_and_builds_only_those(decoder, keep) -> None:
    """``keep``: the columns stage 1 goes on with (what its column steps read). A value
    bad only in a field not kept is still refused with the reference's message, and the
    kept columns are the full decode's."""
    values = [value(user_id=f"u{i}", ts=i, amount=None if i % 4 else 0.5) for i in range(12)]
    values[3:3] = [b for b, _, _ in BAD]
    values.append(value(ok=...))
    full = SCHEMA.decode(pa.array(values, pa.binary()))
    some = SCHEMA.decode(pa.array(values, pa.binary()), keep=keep)

    names = [n for n in SCHEMA.fields if n in keep]  # in declared order
    assert some.table.schema == pa.schema([SCHEMA.arrow_schema.field(n) for n in names])
    assert some.table.to_pylist() == full.table.select(names).to_pylist()
    assert some.rows.tolist() == full.rows.tolist() and some.bad == full.bad
    assert len(full.bad) == len(BAD)


def test_decoding_a_field_the_schema_does_not_declare_is_refused() -> None:
    with pytest.raises(ValueError, match=r"does not declare: \['user'\]"):
        SCHEMA.decode(pa.array([value()], pa.binary()), keep=("user", "ts"))


def test_a_batch_of_several_parse_blocks_and_a_value_longer_than_one_decodes_whole(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Arrow parses a batch in blocks of ``_BLOCK_BYTES``; a value longer than a block
    must still be one row (a block holds the longest value), and no bad value appears."""
    monkeypatch.setattr(schema_module, "_native_decoder", lambda: None)
    monkeypatch.setattr(schema_module, "_BLOCK_BYTES", 1 << 16)
    parses = []
    parse = JsonSchema._parse
    monkeypatch.setattr(
        JsonSchema, "_parse", lambda self, v: parses.append(len(v)) or parse(self, v)
    )
    values = [value(user_id=f"u{i}" + "x" * 200, ts=i) for i in range(2_000)]  # ~0.5 MB
    values.insert(777, value(user_id="long" + "y" * 300_000, ts=-1))
    decoded = SCHEMA.decode(pa.array(values, pa.binary()))

    assert parses == [len(values)], "Arrow refused a block: the batch was split and re-parsed"
    assert decoded.bad == []
    assert decoded.rows.tolist() == list(range(len(values)))
    assert decoded.table.to_pylist() == [SCHEMA.decode_record(v) for v in values]


def test_the_native_path_takes_good_values_whole_and_leaves_arrow_only_the_rest(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Good values never reach ``pyarrow.json``; the odd ones do, alone, and the rows come
    back in input order."""
    parsed = []
    parse = JsonSchema._parse
    monkeypatch.setattr(
        JsonSchema, "_parse", lambda self, v: parsed.extend(v.to_pylist()) or parse(self, v)
    )
    good = [value(user_id=f"u{i}", ts=i, ok=None if i % 2 else True) for i in range(1_000)]
    assert SCHEMA.decode(pa.array(good, pa.binary())).rows.tolist() == list(range(1_000))
    assert parsed == []

    odd = b'{"ts": -0, "user_id": "neg", "n": 0}'
    decoded = SCHEMA.decode(pa.array([*good[:5], odd, value(ts="x"), *good[5:9]], pa.binary()))
    assert parsed[0] == odd
    assert decoded.rows.tolist() == [0, 1, 2, 3, 4, 5, 7, 8, 9, 10]
    assert decoded.table.column("user_id").to_pylist()[5] == "neg"
    assert [row for row, _ in decoded.bad] == [6]


#: JSON text a fuzzer combines into values: the edges where parsers disagree.
_SCALARS = [
    "0", "-0", "1", "-1", "2147483647", "2147483648", "-2147483649", "9223372036854775807",
    "9223372036854775808", "-9223372036854775809", "18446744073709551616", "1.5", "-0.0",
    "1e3", "1E-3", "1e400", "-1e400", "4.9e-324", "2.2250738585072014e-308",
    "9007199254740993", "0.1", "NaN", "Infinity", "-Infinity", "01", "1.", ".5", "+1",
    "true", "false", "null", "tru", '""', '"a"', '"\\u00e9"', '"\\ud83d\\ude00"',
    '"\\ud800"', '"\\n\\t"', '"\t"', '"\u00e9"', '"\U0001F600"', "[]", "{}",
    '[1, {"a": 2}]', '{"ts": 1}',
]  # fmt: skip
_NAMES = ['"user_id"', '"ts"', '"amount"', '"n"', '"ok"', '"other"', '"\\u0074s"', '"TS"']


#: A good value's fields as JSON text, which the fuzzer edits.
_GOOD_TEXT = [(f'"{k}"', json.dumps(v)) for k, v in GOOD.items()]


@st.composite
def _near_good(draw: st.DrawFn) -> str:
    """A good value with a few of its fields replaced, dropped, repeated or joined by
    others: mostly one edge away from good, where a fast path could go wrong."""
    pairs = list(_GOOD_TEXT)
    for _ in range(draw(st.integers(0, 3))):
        name, text = draw(st.sampled_from(_NAMES)), draw(st.sampled_from(_SCALARS))
        edit = draw(st.sampled_from(["replace", "add", "drop"]))
        if edit == "replace":
            i = draw(st.integers(0, len(pairs) - 1))
            pairs[i] = (pairs[i][0], text)
        elif edit == "add":
            pairs.insert(draw(st.integers(0, len(pairs))), (name, text))
        elif pairs:
            pairs.pop(draw(st.integers(0, len(pairs) - 1)))
    return "{" + ", ".join(f"{k}: {v}" for k, v in pairs) + "}"


@settings(max_examples=400, deadline=None)
@given(
    st.lists(_near_good(), min_size=1, max_size=12).map(lambda texts: [*texts, value().decode()]),
    st.sampled_from([b"", b" ", b"\n", b" x", b"\xff"]),
)
def test_any_value_decodes_as_the_reference_decodes_it(texts, tail) -> None:
    """Values built from the JSON edges where parsers part (``-0``, integers past 64
    bits, exponents, ``NaN``, lone surrogates, escaped names, duplicates, trailing bytes):
    whatever path each takes, every row and every error is the reference's."""
    values = [t.encode() + (tail if i % 3 == 0 else b"") for i, t in enumerate(texts)]
    expected_rows, expected_bad = reference(values)
    decoded = SCHEMA.decode(pa.array(values, pa.binary()))
    got = list(zip(decoded.rows.tolist(), decoded.table.to_pylist(), strict=True))
    assert _same(got, expected_rows)
    assert decoded.bad == expected_bad
    some = SCHEMA.decode(pa.array(values, pa.binary()), keep=("ts", "ok"))
    assert some.bad == expected_bad, "a field not kept must be checked all the same"
    kept = [(i, {"ts": r["ts"], "ok": r["ok"]}) for i, r in expected_rows]
    assert list(zip(some.rows.tolist(), some.table.to_pylist(), strict=True)) == kept


def _same(got: list, expected: list) -> bool:
    """Rows equal as values: a NaN equal to a NaN, and a double's ``-0`` (-0.0 in Arrow,
    whichever path took it; 0.0 from Python's int 0) equal to 0.0."""

    def plain(rows: list) -> list:
        return [(i, {k: "NaN" if v != v else v for k, v in r.items()}) for i, r in rows]

    return plain(got) == plain(expected)


def test_decoding_an_empty_batch_gives_the_declared_columns() -> None:
    decoded = SCHEMA.decode(pa.array([], pa.binary()))

    assert decoded.table.num_rows == 0 and decoded.table.schema == SCHEMA.arrow_schema
    assert decoded.bad == [] and len(decoded.rows) == 0


def pipeline(source: KafkaSource, **overrides: object) -> Pipeline:
    kwargs: dict[str, object] = dict(
        name="p", source=source, key_by="user_id", process=Noop(), checkpoints="/tmp/x",
        event_time=EventTime("ts"),
    )  # fmt: skip
    return Pipeline(**{**kwargs, **overrides})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"key_by": "user"}, "key_by 'user' is not a field of the value_schema"),
        ({"key_by": lambda r: r["user_id"]}, "key_by must name a field of it"),
        ({"key_by": "amount"}, "key_by field 'amount' is double"),
        ({"event_time": EventTime("time")}, "event_time field 'time' is not a field"),
        ({"event_time": EventTime("ok")}, "event_time field 'ok' is boolean"),
    ],
)
def test_a_pipeline_whose_key_or_event_time_is_not_in_the_schema_is_refused(
    overrides, message
) -> None:
    with pytest.raises(ConfigError, match=message):
        pipeline(KafkaSource(topics=("t",), value_schema=SCHEMA), **overrides)


def test_a_source_takes_a_schema_or_a_decoder_not_both() -> None:
    pipeline(KafkaSource(topics=("t",), value_schema=SCHEMA))  # fine
    with pytest.raises(ConfigError, match="a decoder or a value_schema, not both"):
        KafkaSource(topics=("t",), value_schema=SCHEMA, decoder=json.loads)
    with pytest.raises(ConfigError, match="value_schema must be a declared schema"):
        KafkaSource(topics=("t",), value_schema={"user_id": "string"})  # type: ignore[arg-type]
