"""Every row of an Arrow table in the codec's fast form at once: the bytes
``encode_values(table.to_pylist())`` gives, without a Python dict per row — and back
(:func:`decode_rows`: payloads of flat records as the columns of a declared schema).

A window hands its output rows to the next keyed step as payloads; with the native
extension (``microbatch_native.encode_rows``) the rows of flat columns — integers, floats,
booleans, strings, bytes, nulls — are packed straight from the Arrow buffers into
MessagePack maps, the same bytes msgpack's packer makes of the dicts. Columns of other
types (timestamps, lists, structs, decimals), duplicate column names, or no extension:
the rows become dicts and take :func:`~microbatch.state.codec.encode_values`.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa

from microbatch.native_buffers import array_of
from microbatch.state.codec import FAST_TAG, decode_values, encode_values

# The extension's column kinds, and the Arrow type each is read as.
_INT, _UINT, _FLOAT, _BOOL, _STRING, _BINARY, _NULL = range(7)


def encode_rows(table: pa.Table) -> pa.Array:
    """``encode_values(table.to_pylist())`` as a binary array (``CodecError`` as there)."""
    native = _native()
    columns = None if native is None else _plain_columns(table)
    if native is None or columns is None:
        return pa.array(encode_values(table.to_pylist()), pa.binary())
    kinds, offsets, buffers = [], [], []
    for kind, array in columns:
        kinds.append(kind)
        offsets.append(array.offset)
        buffers.append(_buffers(kind, array))
    starts, data = native(table.num_rows, table.column_names, kinds, offsets, buffers, FAST_TAG)
    return pa.Array.from_buffers(
        pa.binary(), table.num_rows, [None, pa.py_buffer(starts), pa.py_buffer(data)]
    )


def decode_rows(payloads: pa.Array | pa.ChunkedArray, schema: pa.Schema) -> pa.Table | None:
    """The records of ``payloads`` (codec bytes) as columns of ``schema``, or None when
    any one is not exactly a flat record of its fields — each present once, of its type
    (null where the field is nullable), nothing else — or a field's type is not a string,
    int64, int32, float64 or boolean, or there is no extension. None means: decode them
    as records (:func:`~microbatch.state.codec.decode_values`); a table returned holds
    what that would, as columns."""
    if not len(payloads):  # no record: a table of no rows, whatever the fields' types
        return schema.empty_table()
    kinds = [_DECODED_KINDS.get(field.type) for field in schema]
    native = _native_decoder()
    if native is None or None in kinds or len(set(schema.names)) != len(schema):
        return None
    array = payloads.combine_chunks() if isinstance(payloads, pa.ChunkedArray) else payloads
    if array.null_count or not pa.types.is_binary(array.type):
        return None
    rows = len(array)
    starts = np.frombuffer(array.buffers()[1], dtype=np.int32)[
        array.offset : array.offset + rows + 1
    ]
    data = array.buffers()[2]
    columns = native(
        starts, _bytes(data), FAST_TAG, schema.names, kinds, [f.nullable for f in schema]
    )
    if columns is None:
        return None
    arrays = [
        array_of(field.type, rows, values, validity, nulls, offsets)
        for field, (validity, nulls, values, offsets) in zip(schema, columns, strict=True)
    ]
    return pa.Table.from_arrays(arrays, schema=schema)


def schema_of_records(payloads: pa.Array | pa.ChunkedArray, scan: int = 64) -> pa.Schema | None:
    """The schema the records of ``payloads`` would be rows of if they are alike: the
    fields of the first, each typed by its first non-null value among the first ``scan``
    (int → int64, float → float64, str → string, bool → boolean; all nullable). None when
    the first is no flat record of such values or a field is null throughout the scan.
    A guess: :func:`decode_rows` then checks every record against it."""
    sample = payloads.slice(0, scan).to_pylist()
    if not sample or sample[0] is None:
        return None
    try:
        records = decode_values(sample)
    except Exception:  # not the codec's bytes: no guess
        return None
    first = records[0]
    if type(first) is not dict or not first:
        return None
    types: dict[str, pa.DataType] = {}
    for name in first:
        if type(name) is not str:
            return None
        values = (r.get(name) for r in records if type(r) is dict)
        kind = _TYPE_OF_VALUE.get(type(next((v for v in values if v is not None), None)))
        if kind is None:
            return None
        types[name] = kind
    return pa.schema([pa.field(name, kind) for name, kind in types.items()])


_TYPE_OF_VALUE = {int: pa.int64(), float: pa.float64(), str: pa.string(), bool: pa.bool_()}


# Arrow types decode_rows builds, numbered as the extension's JSON decoder numbers them.
_DECODED_KINDS = {
    pa.string(): 0, pa.int64(): 1, pa.int32(): 2, pa.float64(): 3, pa.bool_(): 4,
}  # fmt: skip


def split_lists(
    payloads: pa.Array, flagged: bool
) -> tuple[pa.Array, np.ndarray, np.ndarray] | None:
    """Payloads each of a list of records (``flagged``: of ``[record, bool]`` pairs, as a
    join holds them in state), split into one payload per record, without a Python
    object per record: the records' payloads, each one's flag, and each list's length.
    None when one is not such a list in the fast form, or there is no extension: decode
    them as values (:func:`~microbatch.state.codec.decode_values`)."""
    try:
        from microbatch_native import split_lists as native
    except ImportError:
        return None
    if payloads.null_count or not pa.types.is_binary(payloads.type):
        return None
    if not len(payloads):
        return pa.array([], pa.binary()), np.zeros(0, bool), np.zeros(0, np.int64)
    starts = np.frombuffer(payloads.buffers()[1], dtype=np.int32)[
        payloads.offset : payloads.offset + len(payloads) + 1
    ]
    split = native(starts, _bytes(payloads.buffers()[2]), FAST_TAG, flagged)
    if split is None:
        return None
    offsets, data, flags, counts = split
    records = pa.Array.from_buffers(
        pa.binary(), len(offsets) // 4 - 1, [None, pa.py_buffer(offsets), pa.py_buffer(data)]
    )
    return records, np.frombuffer(flags, np.uint8).astype(bool), np.frombuffer(counts, np.int64)


def join_lists(
    payloads: pa.Array, counts: np.ndarray, flags: np.ndarray | None = None
) -> pa.Array | None:
    """The inverse of :func:`split_lists`: the records of ``payloads`` (each the fast
    form) laid end to end in lists of ``counts[i]`` — with ``flags``, of ``[record,
    flag]`` pairs — as the codec's bytes of each list, without a Python object per
    record. None without the extension, or when a payload is not the fast form."""
    try:
        from microbatch_native import join_lists as native
    except ImportError:
        return None
    if payloads.null_count or not pa.types.is_binary(payloads.type):
        return None
    starts = np.frombuffer(payloads.buffers()[1], dtype=np.int32)[
        payloads.offset : payloads.offset + len(payloads) + 1
    ] if len(payloads) else np.zeros(1, np.int32)  # fmt: skip
    data = _bytes(payloads.buffers()[2]) if len(payloads) else np.zeros(0, np.uint8)
    marks = None if flags is None else np.ascontiguousarray(flags, dtype=np.uint8)
    joined = native(starts, data, FAST_TAG, np.ascontiguousarray(counts, np.int64), marks)
    if joined is None:
        return None
    offsets, lists = joined
    return pa.Array.from_buffers(
        pa.binary(), len(counts), [None, pa.py_buffer(offsets), pa.py_buffer(lists)]
    )


def _native_decoder() -> Any:
    """``microbatch_native.decode_rows``, or None without the extension."""
    try:
        from microbatch_native import decode_rows as native
    except ImportError:
        return None
    return native


def _native() -> Any:
    """``microbatch_native.encode_rows``, or None without the extension."""
    try:
        from microbatch_native import encode_rows as native
    except ImportError:
        return None
    return native


def _plain_columns(table: pa.Table) -> list[tuple[int, pa.Array]] | None:
    """Each column as (kind, one array of the type the extension reads), or None when a
    column is of another type or two share a name (a dict would keep one of them)."""
    if len(set(table.column_names)) != table.num_columns:
        return None
    columns = []
    for column in table.columns:
        kind = _kind(column.type)
        if kind is None:
            return None
        array = column.combine_chunks()
        target = _READ_AS.get(kind)
        if target is not None and array.type != target:
            try:
                array = array.cast(target)
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError):  # e.g. past 2 GiB of text
                return None
        columns.append((kind, array))
    return columns


_READ_AS = {
    _INT: pa.int64(), _UINT: pa.uint64(), _FLOAT: pa.float64(), _STRING: pa.string(),
    _BINARY: pa.binary(),
}  # fmt: skip


def _kind(kind: pa.DataType) -> int | None:
    if pa.types.is_signed_integer(kind):
        return _INT
    if pa.types.is_unsigned_integer(kind):
        return _UINT
    if pa.types.is_floating(kind):
        return _FLOAT
    if pa.types.is_boolean(kind):
        return _BOOL
    if pa.types.is_string(kind) or pa.types.is_large_string(kind):
        return _STRING
    if pa.types.is_binary(kind) or pa.types.is_large_binary(kind):
        return _BINARY
    if pa.types.is_null(kind):
        return _NULL
    return None


def _buffers(kind: int, array: pa.Array) -> tuple[Any, Any, Any]:
    """(validity, values, value offsets) of ``array`` as numpy views (None: absent)."""
    if kind == _NULL:
        return None, None, None
    bufs = array.buffers()
    validity = None if bufs[0] is None or not array.null_count else _bytes(bufs[0])
    if kind in (_STRING, _BINARY):
        return validity, _bytes(bufs[2]), np.frombuffer(bufs[1], dtype=np.int32)
    return validity, _bytes(bufs[1]), None


def _bytes(buffer: pa.Buffer | None) -> np.ndarray:
    return np.zeros(0, np.uint8) if buffer is None else np.frombuffer(buffer, dtype=np.uint8)
