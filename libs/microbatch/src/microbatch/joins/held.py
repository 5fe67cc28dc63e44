"""Records a join holds in map state between batches, as columns.

The interval and temporal joins keep records in map states by event time: a version per
time (``ONE``), a list of records per time (``LIST``), or a list of ``[record, matched]``
per time (``FLAGGED``). Their ``process`` writes those values with the codec, so a batch
taken on columns reads them back the same way — decoded, each record re-encoded and read
into the columns of its side's schema, all or nothing — and writes what ``process``
would: the codec's bytes of the same lists, built from the records' payloads.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pyarrow as pa

from microbatch.state.codec import FAST_TAG, decode_value, encode_values
from microbatch.state.codec_rows import decode_rows, schema_of_records
from microbatch.state.handles import KeyedMaps

ONE, LIST, FLAGGED = "one", "list", "flagged"


@dataclasses.dataclass(frozen=True)
class Side:
    """One side's records of a batch's keys, by their place ``k`` in the batch: first the
    ``held`` ones read from state, then the batch's (rows ``batch_rows`` of the side's
    table); ``rows`` holds all of them as columns."""

    keys: np.ndarray
    times: np.ndarray
    rows: pa.Table
    held: int
    payloads_held: list[bytes]
    #: Per held record: its ``matched`` flag (``FLAGGED``) and its place in its time's list.
    flags: np.ndarray
    slots: np.ndarray
    batch_rows: np.ndarray = dataclasses.field(default_factory=lambda: np.empty(0, np.int64))

    @classmethod
    def of(
        cls, held: Side, taken: np.ndarray, table: pa.Table, keys: np.ndarray,
        times: np.ndarray,
    ) -> Side:  # fmt: skip
        """``held``'s records of the ``taken`` keys, then those of the batch (``table``,
        with each row's key and time)."""
        kept, rows = taken[held.keys], np.flatnonzero(taken[keys])
        return cls(
            np.concatenate([held.keys[kept], keys[rows]]),
            np.concatenate([held.times[kept], times[rows]]),
            pa.concat_tables(
                [held.rows.filter(pa.array(kept)), table.take(rows)], promote_options="default"
            ),
            int(kept.sum()),
            [p for p, k in zip(held.payloads_held, kept.tolist(), strict=True) if k],
            held.flags[kept],
            held.slots[kept],
            rows,
        )

    def payloads(self, batch_payloads: pa.Array, at: np.ndarray) -> list[bytes]:
        """The codec bytes of the records at ``at``: ``batch_payloads`` are the side's
        payloads in the batch."""
        new = batch_payloads.take(self.batch_rows[at[at >= self.held] - self.held])
        fresh = iter(new.to_pylist())
        held = self.payloads_held
        return [held[i] if i < self.held else next(fresh) for i in at.tolist()]


def read_held(maps: KeyedMaps, keys: np.ndarray, schema: pa.Schema, shape: str) -> Side | None:
    """The records held in map state ``maps`` (of ``shape``) for ``keys``, as rows of
    ``schema`` (as they were stored, when the batch has no record of the side); None when
    one is not such a row."""
    entries = maps.entries_encoded(keys.tolist())
    held_keys: list[int] = []
    times: list[int] = []
    payloads: list[bytes] = []
    flags: list[bool] = []
    slots: list[int] = []
    for k, held in zip(keys.tolist(), entries, strict=True):
        for field, data in held:
            value = decode_value(data)
            if shape == ONE:
                records, matched = [value], [False]
            elif shape == LIST:
                records, matched = value, [False] * len(value)
            else:
                records, matched = [r for r, _ in value], [bool(m) for _, m in value]
            n = len(records)
            held_keys += [k] * n
            times += [decode_value(field)] * n
            slots += range(n)
            flags += matched
            payloads += [data] if shape == ONE else encode_values(records)
    datas = pa.array(payloads, pa.binary())
    if any(pa.types.is_null(t) for t in schema.types):  # no record of the side this batch
        schema = schema_of_records(datas) or schema
    rows = decode_rows(datas, schema)
    if rows is None:
        return None
    return Side(
        np.array(held_keys, np.int64), np.array(times, np.int64), rows, len(payloads), payloads,
        np.array(flags, dtype=bool), np.array(slots, np.int64),
    )  # fmt: skip


def list_of(payloads: list[bytes]) -> bytes:
    """The codec's bytes of the list of the records whose bytes are ``payloads`` (each
    the fast form): what ``encode_value`` of that list gives."""
    return FAST_TAG + _array_header(len(payloads)) + b"".join(p[1:] for p in payloads)


def flagged_list_of(payloads: list[bytes], flags: list[bool]) -> bytes:
    """The codec's bytes of ``[[record, flag], ...]``, the records given as ``payloads``
    (each the fast form)."""
    pairs = (
        b"\x92" + p[1:] + (b"\xc3" if f else b"\xc2") for p, f in zip(payloads, flags, strict=True)
    )
    return FAST_TAG + _array_header(len(payloads)) + b"".join(pairs)


def _array_header(n: int) -> bytes:
    """MessagePack's header of an array of ``n`` values."""
    if n < 16:
        return bytes([0x90 | n])
    if n < 2**16:
        return b"\xdc" + n.to_bytes(2, "big")
    return b"\xdd" + n.to_bytes(4, "big")
