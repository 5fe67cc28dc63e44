"""Canonical key bytes and key-groups of a whole column of integer keys, with numpy.

:mod:`microbatch.keygroups` defines the mapping one key at a time (``b"i"`` + the
minimal big-endian two's complement, then 32-bit MurmurHash3 x86, seed 0, unsigned);
this module computes exactly the same for many int keys at once — the keys of a batch
that were never seen before (all of them, when every record has its own key: people by
id), where a Python call per key costs more than parsing the record. Keys are grouped by
the length of their bytes, and MurmurHash3 runs over each group's 4-byte blocks as
uint32 columns.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from microbatch.keygroups import encode_key, key_group_of_bytes

_C1, _C2 = np.uint32(0xCC9E2D51), np.uint32(0x1B873593)
#: Beyond it, a key's bytes may be 9 long or its absolute value overflow: the caller
#: encodes such keys one by one.
LIMIT = 2**62
#: ``abs(key) >= 2 ** (8j - 1)`` adds a byte (Python's ``(bit_length + 8) // 8``).
_THRESHOLDS = np.array([2 ** (8 * j - 1) for j in range(1, 8)], dtype=np.int64)


def int_key_groups(keys: np.ndarray, max_parallelism: int) -> tuple[pa.Array, np.ndarray]:
    """``(encode_key(k) for k in keys)`` as a binary array and their key-groups
    (``key_group_of_bytes``), for int64 ``keys`` all within ``(-LIMIT, LIMIT)``."""
    keys = np.asarray(keys, dtype=np.int64)
    if len(keys) and (int(keys.max()) >= LIMIT or int(keys.min()) <= -LIMIT):
        raise ValueError("int keys beyond ±2**62 are encoded one by one")
    sizes = 1 + (np.abs(keys)[:, None] >= _THRESHOLDS[None, :]).sum(axis=1)
    unsigned = keys.view(np.uint64)
    groups = np.zeros(len(keys), dtype=np.int64)
    pieces: list[pa.Array] = []
    order: list[np.ndarray] = []
    for size in np.unique(sizes).tolist():
        at = np.nonzero(sizes == size)[0]
        data = np.empty((len(at), size + 1), dtype=np.uint8)
        data[:, 0] = ord("i")
        for i in range(size):  # big-endian: the first byte is the most significant
            data[:, 1 + i] = (unsigned[at] >> np.uint64(8 * (size - 1 - i))).astype(np.uint8)
        groups[at] = _murmur3(data).astype(np.int64) % max_parallelism
        fixed = pa.FixedSizeBinaryArray.from_buffers(
            pa.binary(size + 1), len(at), [None, pa.py_buffer(data.tobytes())]
        )
        pieces.append(fixed.cast(pa.binary()))
        order.append(at)
    if not pieces:
        return pa.array([], pa.binary()), groups
    placed = np.concatenate(order)
    back = np.empty(len(keys), dtype=np.int64)
    back[placed] = np.arange(len(keys))
    return pa.concat_arrays(pieces).take(pa.array(back)), groups


def key_groups_of(keys: pa.Array, max_parallelism: int) -> tuple[pa.Array, np.ndarray]:
    """``encode_key`` and the key-group of each of ``keys`` (no nulls): integers within
    ``±LIMIT`` all at once (:func:`int_key_groups`), any other key one by one."""
    if pa.types.is_integer(keys.type):
        try:
            return int_key_groups(keys.cast(pa.int64()).to_numpy(), max_parallelism)
        except (pa.ArrowInvalid, ValueError):  # beyond int64, or beyond ±LIMIT
            pass
    encoded = [encode_key(k) for k in keys.to_pylist()]
    groups = [key_group_of_bytes(kb, max_parallelism) for kb in encoded]
    return pa.array(encoded, pa.binary()), np.array(groups, dtype=np.int64)


def _rotl(x: np.ndarray, r: int) -> np.ndarray:
    return (x << np.uint32(r)) | (x >> np.uint32(32 - r))


def _murmur3(data: np.ndarray) -> np.ndarray:
    """MurmurHash3 x86 32 (seed 0) of each row of ``data`` (uint8, rows of one length)."""
    rows, length = data.shape
    h = np.zeros(rows, dtype=np.uint32)
    with np.errstate(over="ignore"):
        blocks = length // 4
        for b in range(blocks):
            block = data[:, 4 * b : 4 * b + 4].astype(np.uint32)
            k = block[:, 0] | (block[:, 1] << 8) | (block[:, 2] << 16) | (block[:, 3] << 24)
            h ^= _rotl(k * _C1, 15) * _C2
            h = _rotl(h, 13) * np.uint32(5) + np.uint32(0xE6546B64)
        tail = data[:, 4 * blocks :].astype(np.uint32)
        if tail.shape[1]:
            k = np.zeros(rows, dtype=np.uint32)
            for i in range(tail.shape[1]):
                k |= tail[:, i] << np.uint32(8 * i)
            h ^= _rotl(k * _C1, 15) * _C2
        h ^= np.uint32(length)
        h ^= h >> np.uint32(16)
        h *= np.uint32(0x85EBCA6B)
        h ^= h >> np.uint32(13)
        h *= np.uint32(0xC2B2AE35)
        h ^= h >> np.uint32(16)
    return h
