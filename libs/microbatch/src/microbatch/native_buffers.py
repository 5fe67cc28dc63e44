"""Arrow arrays over the buffers ``microbatch_native`` hands back (Python bytes in
Arrow's layout: validity bitmap, 32-bit offsets, values), without a copy."""

from __future__ import annotations

import pyarrow as pa


def array_of(
    type_: pa.DataType,
    rows: int,
    values: bytes,
    validity: bytes | None = None,
    nulls: int = 0,
    offsets: bytes | None = None,
) -> pa.Array:
    """An array of ``rows`` from the extension's buffers; ``offsets`` for binary and string
    types, ``validity`` None when no row is null."""
    buffers = [None if validity is None else pa.py_buffer(validity)]
    if offsets is not None:
        buffers.append(pa.py_buffer(offsets))
    buffers.append(pa.py_buffer(values))
    return pa.Array.from_buffers(type_, rows, buffers, null_count=nulls)
