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

from microbatch.state.codec import FAST_TAG, decode_value, decode_values, encode_values
from microbatch.state.codec_rows import decode_rows, join_lists, schema_of_records, split_lists
from microbatch.state.handles import KeyedMaps

ONE, LIST, FLAGGED = "one", "list", "flagged"


@dataclasses.dataclass(frozen=True)
class Side:
    """One side's records of a batch's keys, by their place ``k`` in the batch: first the
    ``held`` ones read from state (``held_rows``), then the batch's (rows ``batch_rows``
    of the side's ``table``). Columns are taken from both only for the records asked
    for (:meth:`column`)."""

    keys: np.ndarray
    times: np.ndarray
    held_rows: pa.Table
    held: int
    payloads_held: pa.Array
    #: Per held record: its ``matched`` flag (``FLAGGED``) and its place in its time's list.
    flags: np.ndarray
    slots: np.ndarray
    table: pa.Table | None = None
    batch_rows: np.ndarray = dataclasses.field(default_factory=lambda: np.empty(0, np.int64))

    @classmethod
    def of(
        cls, held: Side, taken: np.ndarray, table: pa.Table, rows: np.ndarray,
        keys: np.ndarray, times: np.ndarray,
    ) -> Side:  # fmt: skip
        """``held``'s records of the ``taken`` keys, then the batch's records at ``rows``
        of ``table`` (``keys``, ``times``: each one's)."""
        kept = taken[held.keys]
        return cls(
            np.concatenate([held.keys[kept], keys]),
            np.concatenate([held.times[kept], times]),
            held.held_rows.filter(pa.array(kept)),
            int(kept.sum()),
            held.payloads_held.filter(pa.array(kept)),
            held.flags[kept],
            held.slots[kept],
            table,
            rows,
        )

    @classmethod
    def of_records(
        cls, held: Side, taken: np.ndarray, table: pa.Table, keys: np.ndarray,
        times: np.ndarray,
    ) -> Side:  # fmt: skip
        """:meth:`of` every record of ``table`` of a ``taken`` key (``keys``, ``times``:
        each row's)."""
        rows = np.flatnonzero(taken[keys])
        return cls.of(held, taken, table, rows, keys[rows], times[rows])

    def is_new(self, at: np.ndarray) -> np.ndarray:
        """Is each record at ``at`` the batch's (not held)?"""
        return at >= self.held

    def rows_of(self, at: np.ndarray) -> np.ndarray:
        """Each record's row in the held rows followed by the side's table (-1 stays)."""
        rows = at.copy()
        new = self.is_new(at)
        rows[new] = self.held + self.batch_rows[at[new] - self.held]
        return rows

    def column(self, field: str, at: np.ndarray) -> pa.ChunkedArray:
        """Field ``field`` of the records at ``at`` (-1: null)."""
        parts = [self.held_rows.select([field])]
        if self.table is not None:
            parts.append(self.table.select([field]))
        every = pa.concat_tables(parts, promote_options="default").column(field)
        return every.take(pa.array(self.rows_of(at), mask=at < 0))

    def payloads(self, batch_payloads: pa.Array, at: np.ndarray) -> pa.Array:
        """The codec bytes of the records at ``at``: ``batch_payloads`` are the side's
        payloads in the batch (row ``i`` of its table)."""
        return pa.concat_arrays([self.payloads_held, batch_payloads]).take(self.rows_of(at))


def read_held(maps: KeyedMaps, keys: np.ndarray, schema: pa.Schema, shape: str) -> Side | None:
    """The records held in map state ``maps`` (of ``shape``) for ``keys``, as rows of
    ``schema`` (as they were stored, when the batch has no record of the side); None when
    one is not such a row."""
    entries = maps.entries_encoded(keys.tolist())
    counts = np.array([len(held) for held in entries], dtype=np.int64)
    owners = np.repeat(keys, counts)  # each entry's key
    fields = [decode_value(field) for held in entries for field, _ in held]
    datas = pa.array([data for held in entries for _, data in held], pa.binary())
    if shape == ONE:
        payloads, flags, lengths = datas, np.zeros(len(datas), bool), np.ones(len(datas), np.int64)
    else:
        split = split_lists(datas, shape == FLAGGED) or _split_in_python(datas, shape)
        payloads, flags, lengths = split
    if any(pa.types.is_null(t) for t in schema.types):  # no record of the side this batch
        schema = schema_of_records(payloads) or schema
    rows = decode_rows(payloads, schema)
    if rows is None:
        return None
    total = int(lengths.sum())
    slots = np.arange(total) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    return Side(
        np.repeat(owners, lengths), np.repeat(np.array(fields, np.int64), lengths), rows, total,
        payloads, flags, slots,
    )  # fmt: skip


def _split_in_python(datas: pa.Array, shape: str) -> tuple[pa.Array, np.ndarray, np.ndarray]:
    """:func:`~microbatch.state.codec_rows.split_lists` by decoding each list (a list in
    the codec's tagged form, or no extension)."""
    records, flags, lengths = [], [], []
    for value in decode_values(datas.to_pylist()):
        if shape == FLAGGED:
            records += [r for r, _ in value]
            flags += [bool(m) for _, m in value]
        else:
            records += value
            flags += [False] * len(value)
        lengths.append(len(value))
    payloads = pa.array(encode_values(records), pa.binary())
    return payloads, np.array(flags, bool), np.array(lengths, np.int64)


def lists_of(
    payloads: pa.Array, counts: np.ndarray, flags: np.ndarray | None = None
) -> list[bytes]:
    """The codec's bytes of each list of records ``payloads`` laid end to end in lists
    of ``counts[i]`` (with ``flags``, of ``[record, flag]`` pairs), as ``process``
    writes them."""
    joined = join_lists(payloads, counts, flags)
    if joined is not None:
        out: list[bytes] = joined.to_pylist()
        return out
    records, marks = iter(payloads.to_pylist()), iter([] if flags is None else flags.tolist())
    if flags is None:
        return [list_of([next(records) for _ in range(n)]) for n in counts.tolist()]
    return [flagged_list_of([next(records) for _ in range(n)], [next(marks) for _ in range(n)])
            for n in counts.tolist()]  # fmt: skip


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
