"""Which rows a keyed step takes as its own, and which ride on to a later step."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.compute as pc

from microbatch.runtime.envelope import DEAD_LETTER, ENVELOPE_SCHEMA, RECORD, STAT
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
