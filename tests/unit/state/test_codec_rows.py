"""A table's rows packed at once from its columns are byte for byte the codec's encoding
of each row's dict — for every type the extension packs, nulls, slices and edge values."""

from __future__ import annotations

import itertools
import random

import numpy as np
import pyarrow as pa
import pytest

from microbatch.state import codec_rows
from microbatch.state.codec import CodecError, decode_values, encode_values
from microbatch.state.codec_rows import encode_rows

INT_EDGES = [
    0,
    1,
    31,
    32,
    127,
    128,
    255,
    256,
    65535,
    65536,
    2**31 - 1,
    2**31,
    2**32 - 1,
    2**32,
    2**63 - 1,
    -1,
    -32,
    -33,
    -128,
    -129,
    -32768,
    -32769,
    -(2**31),
    -(2**31) - 1,
    -(2**63),
]
TEXT_LENGTHS = [0, 1, 31, 32, 255, 256, 65535, 65536]


@pytest.fixture(params=["native", "dicts"])
def path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each test on the extension (which ``make setup`` builds: it must be there) and on
    the dicts path it falls back to without it."""
    if request.param == "native":
        assert codec_rows._native() is not None, "microbatch_native is missing"
    else:
        monkeypatch.setattr(codec_rows, "_native", lambda: None)
    return str(request.param)


def edge_table() -> pa.Table:
    n = max(len(INT_EDGES), len(TEXT_LENGTHS)) + 3
    rng = random.Random(5)

    def cycle(values: list, i: int) -> object:
        return values[i % len(values)]

    return pa.table(
        {
            "i64": pa.array([cycle(INT_EDGES, i) for i in range(n)], pa.int64()),
            "i8": pa.array([cycle([-128, -33, -1, 0, 127], i) for i in range(n)], pa.int8()),
            "u64": pa.array(
                [cycle([0, 127, 128, 2**64 - 1, 2**32], i) for i in range(n)], pa.uint64()
            ),
            "f64": pa.array(
                [cycle([0.0, -0.0, 1.5, 1e300, float("inf"), -2.5e-310], i) for i in range(n)]
            ),
            "f32": pa.array([cycle([0.1, -3.25], i) for i in range(n)], pa.float32()),
            "ok": pa.array([i % 3 == 0 for i in range(n)]),
            "text": pa.array(["x" * cycle(TEXT_LENGTHS, i) for i in range(n)]),
            "uni": pa.array(["ünïcødé €" * (i % 4) for i in range(n)], pa.large_string()),
            "raw": pa.array(
                [bytes(rng.randrange(256) for _ in range(cycle(TEXT_LENGTHS, i))) for i in range(n)]
            ),
            "nothing": pa.nulls(n),
            "holes": pa.array([None if i % 2 else i for i in range(n)], pa.int64()),
            "maybe": pa.array([None if i % 3 else "s" for i in range(n)]),
            "flags": pa.array([None if i % 4 == 1 else bool(i % 2) for i in range(n)]),
        }
    )


def test_every_packed_type_gives_the_bytes_of_the_dicts(path: str) -> None:
    table = edge_table()
    assert encode_rows(table).to_pylist() == encode_values(table.to_pylist())
    assert decode_values(encode_rows(table).to_pylist()) == table.to_pylist()


def test_slices_and_chunks_are_read_from_their_offsets(path: str) -> None:
    table = pa.concat_tables([edge_table(), edge_table().slice(3, 9)])
    for part in (table.slice(5, 20), table.slice(0, 0), table.slice(30)):
        assert encode_rows(part).to_pylist() == encode_values(part.to_pylist())


def test_a_table_of_sixteen_columns_and_more_packs_a_longer_map_header(path: str) -> None:
    table = pa.table({f"c{i}": pa.array([i, -i, None], pa.int64()) for i in range(17)})
    assert encode_rows(table).to_pylist() == encode_values(table.to_pylist())


def test_other_types_and_duplicate_names_take_the_dicts_path() -> None:
    table = pa.table({"when": pa.array([1, 2], pa.timestamp("ms", tz="UTC")), "xs": [[1], [2, 3]]})
    assert codec_rows._plain_columns(table) is None
    assert encode_rows(table).to_pylist() == encode_values(table.to_pylist())
    twice = pa.Table.from_arrays([pa.array([1]), pa.array([2])], names=["a", "a"])
    assert codec_rows._plain_columns(twice) is None


def test_a_value_the_codec_refuses_raises_as_the_codec_does(path: str) -> None:
    odd = pa.table({"d": pa.array([1, 2], pa.decimal128(5, 1))})
    with pytest.raises(CodecError):
        encode_values(odd.to_pylist())
    with pytest.raises(CodecError):
        encode_rows(odd)


# decode_rows: payloads back into the columns of a declared schema --------------------------

DECLARED = pa.schema([
    ("id", pa.int64()), ("n", pa.int32()), ("x", pa.float64()), ("ok", pa.bool_()),
    ("name", pa.string()), pa.field("maybe", pa.int64(), nullable=True),
    pa.field("must", pa.string(), nullable=False),
])  # fmt: skip


def declared_table(n: int = 40) -> pa.Table:
    rng = random.Random(9)
    i32 = [v for v in INT_EDGES if -(2**31) <= v < 2**31]
    return pa.table(
        {
            "id": [INT_EDGES[i % len(INT_EDGES)] for i in range(n)],
            "n": pa.array([i32[i % len(i32)] for i in range(n)], pa.int32()),
            "x": [[0.0, -0.0, 1.5, 1e300, float("inf"), -2.5e-310][i % 6] for i in range(n)],
            "ok": [None if i % 5 == 1 else i % 2 == 0 for i in range(n)],
            "name": [
                "ünï €" * (i % 3) + "x" * TEXT_LENGTHS[i % len(TEXT_LENGTHS)] for i in range(n)
            ],
            "maybe": [None if i % 2 else rng.randrange(-(2**40), 2**40) for i in range(n)],
            "must": [f"m{i}" for i in range(n)],
        },
        schema=DECLARED,
    )


def test_payloads_of_rows_decode_into_the_same_columns_and_the_same_records() -> None:
    table = declared_table()
    payloads = encode_rows(table)
    decoded = codec_rows.decode_rows(payloads, DECLARED)
    assert decoded is not None and decoded.equals(table)
    assert decoded.to_pylist() == decode_values(payloads.to_pylist())
    for part in (payloads.slice(7, 11), payloads.slice(0, 0), pa.chunked_array([payloads] * 2)):
        again = codec_rows.decode_rows(part, DECLARED)
        assert again is not None and again.to_pylist() == decode_values(part.to_pylist())


def test_a_record_written_field_by_field_in_another_order_decodes_too() -> None:
    record = dict(reversed(declared_table(1).to_pylist()[0].items()))
    decoded = codec_rows.decode_rows(pa.array(encode_values([record]), pa.binary()), DECLARED)
    assert decoded is not None and decoded.to_pylist() == [record]


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({"extra": 1}, "a field the schema does not declare"),
        ({"x": 1}, "an int where a double is declared"),
        ({"n": 2**31}, "past int32"),
        ({"id": 2**63}, "past int64"),
        ({"id": True}, "a bool where an int is declared"),
        ({"name": b"raw"}, "bytes where a string is declared"),
        ({"must": None}, "null in a field that is not nullable"),
        ({"id": [1]}, "a list"),
    ],
)
def test_one_record_that_is_not_a_row_of_the_schema_sends_all_to_the_records_path(
    change: dict, why: str
) -> None:
    rows = declared_table(3).to_pylist()
    rows[1] = {**rows[1], **change}
    payloads = pa.array(encode_values(rows), pa.binary())
    assert codec_rows.decode_rows(payloads, DECLARED) is None, why


def test_missing_fields_other_values_and_other_types_send_all_to_the_records_path() -> None:
    rows = declared_table(2).to_pylist()
    del rows[0]["maybe"]  # absent is not null: a dict would lack the key
    assert codec_rows.decode_rows(pa.array(encode_values(rows), pa.binary()), DECLARED) is None
    for value in (None, 5, "text"):  # a tombstone's record, not a map at all
        payloads = pa.array(encode_values([value]), pa.binary())
        assert codec_rows.decode_rows(payloads, DECLARED) is None
    tagged = pa.array([b"X" + encode_values(rows[1:])[0][1:]], pa.binary())
    assert codec_rows.decode_rows(tagged, DECLARED) is None  # not the fast form
    assert codec_rows.decode_rows(pa.array([None], pa.binary()), DECLARED) is None
    when = pa.schema([("t", pa.timestamp("ms"))])
    assert codec_rows.decode_rows(pa.array(encode_values([{"t": 1}]), pa.binary()), when) is None


def test_no_payload_is_a_table_of_no_rows_whatever_the_types() -> None:
    """A side without records, or nothing stored, is no reason to leave the columns."""
    unknown = pa.schema([("v", pa.null()), ("t", pa.timestamp("ms"))])
    for schema in (DECLARED, unknown):
        table = codec_rows.decode_rows(pa.array([], pa.binary()), schema)
        assert table is not None and table.num_rows == 0 and table.schema == schema


def test_the_schema_of_alike_records_is_guessed_from_the_first_and_checked_on_all() -> None:
    rows = [
        {"key": "k", "n": None, "x": 1.5, "ok": True},
        {"key": "j", "n": 3, "x": 2.0, "ok": False},
    ]
    payloads = pa.array(encode_values(rows), pa.binary())
    schema = codec_rows.schema_of_records(payloads)
    assert schema == pa.schema([("key", pa.string()), ("n", pa.int64()), ("x", pa.float64()),
                                ("ok", pa.bool_())])  # fmt: skip
    decoded = codec_rows.decode_rows(payloads, schema)
    assert decoded is not None and decoded.to_pylist() == rows
    later = pa.array(encode_values([*rows, {**rows[0], "x": 3}]), pa.binary())
    assert codec_rows.decode_rows(later, codec_rows.schema_of_records(later)) is None


@pytest.mark.parametrize(
    "first",
    [None, 5, [1, 2], {}, {"n": None}, {"nested": {"a": 1}}, {"raw": b"x"}, {1: "int key"}],
)
def test_no_schema_is_guessed_from_records_that_are_no_flat_rows(first: object) -> None:
    payloads = pa.array(encode_values([first, {"other": 1}]), pa.binary())
    assert codec_rows.schema_of_records(payloads) is None


def lists(values: list) -> pa.Array:
    return pa.array(encode_values(values), pa.binary())


def test_lists_of_records_split_into_the_payloads_of_their_records() -> None:
    """What a join holds per time — a list of records, or of ``[record, matched]`` — split
    into one payload per record, each the bytes ``encode_values`` gives the record."""
    rng = random.Random(5)
    records = [{"id": i, "name": "x" * rng.randrange(40), "score": rng.random(),
                "tags": ["a", {"deep": [1, None, True]}], "big": -(2**63), "raw": b"\x00\xff"}
               for i in range(70_000)]  # fmt: skip
    cuts = [0, 0, 1, 16, 17, 40, 69_999, 70_000]  # fixarray, array16, array32 lengths
    held = [records[a:b] for a, b in itertools.pairwise(cuts)]
    split = codec_rows.split_lists(lists(held), flagged=False)
    assert split is not None
    payloads, flags, lengths = split
    assert payloads.to_pylist() == encode_values(records)
    assert lengths.tolist() == [len(h) for h in held] and not flags.any()
    pairs = [[[r, i % 3 == 0] for i, r in enumerate(h)] for h in held[:5]]
    split = codec_rows.split_lists(lists(pairs).slice(1), flagged=True)  # an offset, too
    assert split is not None
    payloads, flags, lengths = split
    assert payloads.to_pylist() == encode_values([r for p in pairs[1:] for r, _ in p])
    assert flags.tolist() == [m for p in pairs[1:] for _, m in p]
    assert lengths.tolist() == [len(p) for p in pairs[1:]]


def test_records_joined_into_lists_are_the_bytes_of_the_lists() -> None:
    records = [{"id": i, "name": f"n{i}", "x": [i, None]} for i in range(66_000)]
    counts = [0, 3, 15, 16, 65_535, 431]
    flags = [i % 2 == 0 for i in range(66_000)]
    payloads = pa.array(encode_values(records), pa.binary()).slice(0)
    starts = list(itertools.accumulate([0, *counts]))
    plain = codec_rows.join_lists(payloads, np.array(counts))
    assert plain is not None
    assert plain.to_pylist() == encode_values([records[a:b] for a, b in itertools.pairwise(starts)])
    paired = codec_rows.join_lists(payloads, np.array(counts), np.array(flags))
    assert paired is not None
    assert paired.to_pylist() == encode_values(
        [[[r, f] for r, f in zip(records[a:b], flags[a:b], strict=True)]
         for a, b in itertools.pairwise(starts)]
    )  # fmt: skip
    split = codec_rows.split_lists(paired, flagged=True)
    assert split is not None and split[0].to_pylist() == payloads.to_pylist()
    tagged = pa.array([b"X" + encode_values([{"a": 1}])[0][1:]], pa.binary())
    assert codec_rows.join_lists(tagged, np.array([1])) is None


@pytest.mark.parametrize(
    ("values", "flagged"),
    [
        ([[{"a": (1, 2)}]], False),  # a tuple inside: the tagged form
        ([{"a": 1}], False),  # no list
        ([[[{"a": 1}]]], True),  # a flagged entry that is no pair
        ([[[{"a": 1}, 1]]], True),  # a flag that is no bool
        ([[{"a": 1}]], True),  # a record where a pair should be
    ],
)
def test_what_is_no_such_list_is_left_to_python(values: list, flagged: bool) -> None:
    assert codec_rows.split_lists(lists(values), flagged) is None
    trailing = pa.array([encode_values([[{"a": 1}]])[0] + b"\xc0"], pa.binary())
    assert codec_rows.split_lists(trailing, flagged=False) is None
