"""Records packed for the next exchange come back as the same wire rows, each on the
instance it was for, whatever their number and however they are chunked."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.compute as pc
import pytest

from microbatch.errors import BatchError
from microbatch.runtime import packed as packing
from microbatch.runtime.envelope import DEAD_LETTER, ENVELOPE_SCHEMA, PACKED, RECORD, STAT
from microbatch.runtime.packed import packed, packed_wire, unpacked
from microbatch.runtime.wire import Tags, tags_of
from tests.unit.dataflow.test_handon_columns import router


def handed_on(n: int) -> tuple[pa.RecordBatch, Tags]:
    """``n`` records a window step hands on (to 3 instances), and the pipeline's tags."""
    r = router()
    columns = {
        "key": list(range(n)),
        "window_start": [2_000 * (i % 7) for i in range(n)],
        "window_end": [2_000 * (i % 7) + 10_000 for i in range(n)],
        "count": [i % 5 for i in range(n)],
    }
    assert r.emit_columns(pa.table({k: pa.array(v, pa.int64()) for k, v in columns.items()}))
    return r.record_rows(), tags_of(r.pipeline)


def per_instance(rows: pa.Table) -> dict[int, list[dict]]:
    out: dict[int, list[dict]] = {}
    for row in rows.to_pylist():
        out.setdefault(row["instance"], []).append(row)
    return {i: sorted(v, key=lambda r: (r["partition"], r["offset"])) for i, v in out.items()}


@pytest.mark.parametrize("chunk", [3, 1000])
def test_packed_rows_unpack_to_the_same_wire_rows_on_their_instances(monkeypatch, chunk) -> None:
    monkeypatch.setattr(packing, "PACK_ROWS", chunk)
    rows, tags = handed_on(200)
    packs = packed(rows, tags)
    assert set(packs.column("kind").to_pylist()) == {PACKED}
    assert packs.num_rows == (sum(-(-n // chunk) for n in _counts(rows).values()))
    # on the wire: the packs with a stat row beside them, as an instance receives them
    stat = pa.RecordBatch.from_pylist(
        [{"kind": STAT, "instance": 1, "payload": b"{}"}], schema=ENVELOPE_SCHEMA
    )
    received = tags.to_wire(pa.Table.from_batches([packs, stat]))
    back = unpacked(received, tags, "test")
    kinds = back.column("kind")
    records = back.filter(pc.equal(kinds, tags.kind_code(RECORD)))
    assert per_instance(tags.from_wire(records)) == per_instance(pa.Table.from_batches([rows]))
    assert back.filter(pc.equal(kinds, tags.kind_code(STAT))).num_rows == 1


def _counts(rows: pa.RecordBatch) -> dict[int, int]:
    out: dict[int, int] = {}
    for i in rows.column("instance").to_pylist():
        out[i] = out.get(i, 0) + 1
    return out


def test_nothing_to_pack_is_no_row_and_rows_without_packs_stay_as_they_are() -> None:
    rows, tags = handed_on(0)
    assert packed(rows, tags).num_rows == 0
    wire = tags.to_wire(pa.Table.from_batches([rows]))
    assert unpacked(wire, tags, "test") is wire


def test_a_pack_of_rows_of_another_schema_is_an_error_naming_the_batch() -> None:
    rows, tags = handed_on(10)
    packs = packed(rows, tags)
    odd = pa.BufferOutputStream()
    with pa.ipc.new_stream(odd, pa.schema([("x", pa.int8())])) as writer:
        writer.write_batch(pa.record_batch([pa.array([1], pa.int8())], names=["x"]))
    payload = packs.schema.get_field_index("payload")
    packs = packs.set_column(
        payload, "payload", pa.array([odd.getvalue().to_pybytes()] * packs.num_rows)
    )
    with pytest.raises(BatchError, match="pipeline 'p' batch 7: a packed row"):
        unpacked(tags.to_wire(pa.Table.from_batches([packs])), tags, "pipeline 'p' batch 7")


def test_stage_one_rows_keep_their_other_rows_and_value_columns(monkeypatch) -> None:
    """Stage 1's rows on the wire, with a declared schema's value column: records and
    partials packed, stat rows and dead letters left as rows, all back alike."""
    monkeypatch.setattr(packing, "PACK_ROWS", 4)
    records, tags = handed_on(30)
    schema = ENVELOPE_SCHEMA.append(pa.field("value_price", pa.int64()))
    rows = pa.Table.from_batches([records]).to_pylist()
    rows = [r | {"value_price": i} for i, r in enumerate(rows)]
    rows += [{"kind": STAT, "instance": i, "payload": b"{}", "value_price": None} for i in range(3)]
    rows.append({"kind": DEAD_LETTER, "instance": 2, "payload": b"x", "value_price": None})
    plain = pa.RecordBatch.from_pylist(rows, schema=schema)
    wire = tags.to_wire(plain)
    out = packed_wire(wire, tags)
    assert out.schema == wire.schema
    kinds = tags.from_wire(out).column("kind").to_pylist()
    assert kinds.count(STAT) == 3 and kinds.count(DEAD_LETTER) == 1 and RECORD not in kinds
    back = tags.from_wire(unpacked(pa.Table.from_batches([out]), tags, "test"))
    key = lambda r: (r["kind"], r["instance"], r["partition"] or 0, r["offset"] or 0)  # noqa: E731
    assert sorted(back.to_pylist(), key=key) == sorted(plain.to_pylist(), key=key)


def test_rows_without_records_go_as_they_are() -> None:
    _, tags = handed_on(0)
    stat = tags.to_wire(
        pa.RecordBatch.from_pylist([{"kind": STAT, "instance": 0}], schema=ENVELOPE_SCHEMA)
    )
    assert packed_wire(stat, tags) is stat
