"""Records packed for the next exchange come back as the same wire rows, each on the
instance it was for, whatever their number and however they are chunked."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.compute as pc
import pytest

from microbatch.errors import BatchError
from microbatch.runtime import packed as packing
from microbatch.runtime.envelope import ENVELOPE_SCHEMA, PACKED, RECORD, STAT
from microbatch.runtime.packed import packed, unpacked
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
