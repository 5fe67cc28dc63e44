"""A call's records handed on all at once give the rows, dead letters and sink output of
handing them on one by one."""

from __future__ import annotations

import datetime as dt
from typing import Any

import pytest

from microbatch.dataflow import Dataflow
from microbatch.runtime import DeadLetterSink, EventTime, KafkaSource, KeyedProcessFunction
from microbatch.runtime import ParquetSink as Parquet
from microbatch.runtime.envelope import decode_payload, encode_payload
from microbatch.runtime.handon import hand_on
from microbatch.runtime.router import Router
from microbatch.state.codec import CodecError, decode_value, encode_value, encode_values
from tests.unit.dataflow.test_router import handed_on


class Echo(KeyedProcessFunction):
    def process(self, key: Any, records: Any, ctx: Any) -> None: ...


def router(tap: bool = False) -> tuple[Router, list]:
    flow = Dataflow("h", checkpoints="/tmp/h", event_time=EventTime(field="ts"),
                    dead_letters=DeadLetterSink(path="/tmp/h-dead"), max_parallelism=8,
                    parallelism=2)  # fmt: skip
    first = flow.source(KafkaSource(topics=("t",))).key_by("card")
    first = first.process(Echo(), uid="a", outputs=[Parquet("alerts", "/tmp/h-alerts")])
    if tap:
        first.to(Parquet("all", "/tmp/h-all"))
    first.key_by("merchant").process(Echo(), uid="b").to(Parquet("o", "/tmp/h-o"))
    dead: list = []
    return Router("w", flow.build(), None, 2, lambda *a, **k: dead.append((a, k))), dead


def one_by_one(records: list[tuple[str | None, Any]], key_group: int, tap: bool = False):
    r, dead = router(tap)
    for sink, record in records:
        r.emit([(sink, record)], key_group)  # a call of one record: record by record
    return handed_on(r).to_pylist(), r.outputs, dead


def at_once(records: list[tuple[str | None, Any]], key_group: int, tap: bool = False):
    r, dead = router(tap)
    r.emit(records, key_group)
    return handed_on(r).to_pylist(), r.outputs, dead


PLAIN = [
    {"merchant": "m1", "amount": 5, "ts": 10, "ok": True, "note": None, "rate": 0.5},
    {"merchant": 7, "amount": -1, "ts": 11, "raw": b"\x00\xff", "big": 2**80},
    {"merchant": "m1", "amount": 2, "ts": 12, "name": "ünï", "nan": float("nan")},
    {"merchant": "m2", "ts": 13, "nested": {"a": [1, (2, 3)]}},  # checked one by one
    {"ts": 14, "merchant": "m3"},
]


def test_a_run_is_encoded_to_the_bytes_of_encode_payload_each() -> None:
    assert encode_values(PLAIN) == [encode_payload(r) for r in PLAIN]
    assert [decode_payload(p)["merchant"] for p in encode_values(PLAIN)] == [
        "m1", 7, "m1", "m2", "m3",
    ]  # fmt: skip


@pytest.mark.parametrize(
    "odd",
    [{"v": (1, 2)}, {"v": dt.date(2024, 1, 1)}, {"v": bytearray(b"x")}, {(1, 2): 1}, {"v": 2**80}],
)
def test_a_run_with_a_value_of_the_tagged_form_still_decodes_alike(odd: dict) -> None:
    run = [{"ts": 1}, odd, {"ts": 2}]
    assert [decode_payload(p) for p in encode_values(run)] == [
        decode_value(encode_value(r)) for r in run
    ]
    assert encode_values(run) == [encode_value(r) for r in run]


def test_a_run_with_a_value_the_codec_refuses_raises_like_the_codec() -> None:
    with pytest.raises(CodecError):
        encode_values([{"ts": 1}, {"v": {"a"}}])


def test_a_run_of_records_gives_the_rows_of_one_by_one() -> None:
    records = [(None, r) for r in PLAIN] + [("alerts", {"card": "c1"})]
    fast, slow = at_once(records, 3), one_by_one(records, 3)
    assert fast == slow
    rows = fast[0]
    assert [(x["partition"], x["offset"]) for x in rows] == [(3, i) for i in range(5)]
    assert [x["key"] for x in rows] == [b"sm1", b"i\x07", b"sm1", b"sm2", b"sm3"]
    assert fast[1]["alerts"] == [{"card": "c1"}]


def test_window_rows_without_the_time_field_go_at_once_at_their_windows_last_ms() -> None:
    rows = [{"merchant": m, "window_start": 0, "window_end": 60_000, "count": n}
            for m, n in (("m1", 3), ("m2", 1), ("m1", 2), ("m3", 7))]  # fmt: skip
    run = hand_on(rows, "merchant", "ts", False, {}, lambda kb: (kb, 0, 0), 10)
    assert run is not None and run.event_ts == [59_999] * 4  # not the record-by-record path
    records = [(None, r) for r in rows]
    fast, slow = at_once(records, 2), one_by_one(records, 2)
    assert fast == slow
    assert [x["event_ts"] for x in fast[0]] == [59_999] * 4


@pytest.mark.parametrize(
    "bad",
    [
        {"amount": 1, "ts": 5},  # no key: missing_key
        {"merchant": 1.5, "ts": 5},  # a float key
        {"merchant": "m9", "ts": "2024-01-01T00:00:00Z"},  # an event time to convert
        {"merchant": "m9", "ts": "soon"},  # bad_event_time
        {"merchant": "m9"},  # missing_event_time? no: no window, so no time
        {"merchant": "m9", "ts": 5, "v": dt.datetime(2024, 1, 1)},  # the state codec's
    ],
)
def test_a_run_with_an_odd_record_gives_the_rows_and_dead_letters_of_one_by_one(
    bad: dict,
) -> None:
    records = [(None, r) for r in PLAIN[:3]] + [(None, bad), (None, PLAIN[4])]
    fast, slow = at_once(records, 5), one_by_one(records, 5)
    assert fast == slow
    assert [x["offset"] for x in fast[0]] == list(range(len(fast[0])))


def test_a_tap_gets_the_records_and_a_side_output_to_it_keeps_its_place() -> None:
    records = [(None, PLAIN[0]), ("all", {"x": 1}), (None, PLAIN[1]), (None, PLAIN[2])]
    fast, slow = at_once(records, 1, tap=True), one_by_one(records, 1, tap=True)
    assert fast == slow
    assert fast[1]["all"] == [PLAIN[0], {"x": 1}, PLAIN[1], PLAIN[2]]
    plain = [(None, r) for r in PLAIN[:3]] * 2
    fast, slow = at_once(plain, 1, tap=True), one_by_one(plain, 1, tap=True)
    assert fast == slow and len(fast[1]["all"]) == 6


def test_keys_placed_once_are_placed_the_same_in_later_runs() -> None:
    r, _ = router()
    r.emit([(None, {"merchant": k, "ts": 1}) for k in ("a", "b", 3, "a")], 0)
    r.emit([(None, {"merchant": k, "ts": 2}) for k in ("b", 3, "c", "a")], 0)
    rows = handed_on(r).to_pylist()
    placed = {}
    for x in rows:
        placed.setdefault(x["key"], set()).add((x["key_group"], x["instance"]))
    assert all(len(v) == 1 for v in placed.values()) and len(placed) == 4
    assert [x["offset"] for x in rows] == list(range(8))
