"""Which rows a keyed step takes as its own, and which ride on to a later step."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.compute as pc
import pytest

from microbatch.runtime import spine
from microbatch.runtime.envelope import DEAD_LETTER, ENVELOPE_SCHEMA, RECORD, RESULT, STAT
from microbatch.runtime.spine import rows_for_later


def rows(*kind_topic: tuple[str, str | None]) -> pa.Table:
    n = len(kind_topic)
    cols = {f.name: pa.nulls(n, f.type) for f in ENVELOPE_SCHEMA}
    cols["kind"] = pa.array([k for k, _ in kind_topic], pa.string())
    cols["topic"] = pa.array([t for _, t in kind_topic], pa.string())
    return pa.table(cols, schema=ENVELOPE_SCHEMA)


def test_records_for_later_steps_ride_on_and_everything_else_stays() -> None:
    table = rows(
        (RECORD, "orders"),  # the first step's, from the source
        (RECORD, "payments>sides"),  # a source's records for a later step
        (RECORD, "@totals>ledger"),
        (DEAD_LETTER, None),  # a dead letter of a step: no source coordinates
        (STAT, "orders"),
    )
    first = rows_for_later(table, None)
    assert first is not None and first.to_pylist() == [False, True, True, False, False]
    ledger = rows_for_later(table, "ledger")
    assert ledger is not None and ledger.to_pylist() == [True, True, False, False, False]
    kept = table.filter(pc.invert(ledger))
    assert DEAD_LETTER in kept.column("kind").to_pylist(), "a dead letter was dropped"


def test_a_chain_without_rows_for_later_steps_keeps_every_row() -> None:
    assert rows_for_later(rows((RECORD, "orders"), (DEAD_LETTER, None)), None) is None


def envelope(rows_: list[dict]) -> pa.Table:
    cols = {f.name: [r.get(f.name) for r in rows_] for f in ENVELOPE_SCHEMA}
    return pa.table(cols, schema=ENVELOPE_SCHEMA)


def test_records_cross_an_exchange_packed_per_instance_and_come_back_alike(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(spine, "_BUNDLE_ROWS", 3)  # instance 1's 4 records: two bundles
    records = [
        {"kind": RECORD, "topic": "@a>b", "partition": kg, "offset": i, "seq": 0,
         "instance": kg % 2, "key_group": kg, "key": f"k{i}".encode(), "event_ts": i,
         "payload": bytes([0, i])}
        for i, kg in enumerate([1, 2, 3, 5, 7, 4])
    ]  # fmt: skip
    others = [
        {"kind": DEAD_LETTER, "instance": 1, "payload": b"why"},
        {"kind": STAT, "topic": "t", "partition": 0, "instance": 0, "payload": b"s"},
        {"kind": RESULT, "topic": "a", "instance": 0, "payload": b"{}"},
    ]
    mixed = envelope([records[0], others[0], *records[1:4], others[1], *records[4:], others[2]])
    batches = spine.bundled(mixed)
    crossed = pa.Table.from_batches(batches)
    kinds = crossed.column("kind").to_pylist()
    assert kinds == [DEAD_LETTER, STAT, RESULT, spine.BUNDLE, spine.BUNDLE, spine.BUNDLE]
    assert crossed.column("instance").to_pylist()[3:] == [0, 1, 1]
    back = spine.unbundled(crossed)
    assert back.to_pylist() == envelope(others + records[1:2] + records[5:] + [
        records[0], records[2], records[3], records[4]]).to_pylist()  # fmt: skip
    assert spine.unbundled(envelope(others)).to_pylist() == envelope(others).to_pylist()
    assert spine.bundled(envelope(others))[0].num_rows == 3
