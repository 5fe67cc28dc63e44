"""Key → key-group → operator instance: the one place this mapping is computed.

Flink's scheme (seed 004). A pipeline fixes ``max_parallelism`` key-groups up front; a key
belongs to key-group ``murmur3(canonical_key_bytes) % max_parallelism`` forever, and
operator instance ``i`` of ``P`` owns one contiguous range of key-groups::

    start(i) = ceil(i * maxP / P)          end(i) = floor(((i + 1) * maxP - 1) / P)
    operator_index(kg) = kg * P // maxP

so changing ``P`` moves whole key-groups between instances (mostly to neighbours) and a
restore reads contiguous byte ranges. Seed example, ``maxP = 10``: ``P = 2`` →
``[0-4], [5-9]``; ``P = 3`` → ``[0-3], [4-6], [7-9]``.

**Canonical key bytes** (stable across processes, machines and Python versions — unlike
the salted built-in ``hash()``). One tag byte, then:

- ``str``   → ``b"s"`` + UTF-8
- ``int``   → ``b"i"`` + minimal big-endian two's complement (``0`` → one zero byte)
- ``bytes`` → ``b"y"`` + the bytes (``bytearray``/``memoryview`` encode like ``bytes``)
- ``tuple`` → ``b"t"`` + 4-byte big-endian element count, then per element a 4-byte
  big-endian length and the element's canonical bytes (elements: any key type)

``bool``, ``float``, ``None`` and everything else are refused: they make ambiguous keys
(``True == 1``, ``0.1 + 0.2``). The hash is 32-bit MurmurHash3 x86 (seed 0), unsigned.
"""

from __future__ import annotations

import dataclasses
import functools
import struct
from collections.abc import Iterator
from typing import Union

import mmh3

from microbatch.errors import StateError

Key = Union[str, int, bytes, tuple["Key", ...]]  # noqa: UP007 (recursive alias)

#: Flink's upper bound for max_parallelism (key-group ids must fit in 15 bits).
MAX_PARALLELISM_LIMIT = 32768
_U32 = struct.Struct(">I")


def encode_key(key: Key) -> bytes:
    """The canonical bytes of ``key`` (see the module docstring)."""
    # The common exact types first: this runs once per distinct key of a batch.
    if type(key) is str:
        return b"s" + key.encode("utf-8")
    if type(key) is int:
        return b"i" + key.to_bytes((key.bit_length() + 8) // 8, "big", signed=True)
    if isinstance(key, str):
        return b"s" + key.encode("utf-8")
    if isinstance(key, bool):
        raise StateError(f"keys may not be bool (True == 1 would collide): {key!r}")
    if isinstance(key, int):
        length = (key.bit_length() + 8) // 8  # room for the sign bit
        return b"i" + key.to_bytes(length, "big", signed=True)
    if isinstance(key, bytes | bytearray | memoryview):
        return b"y" + bytes(key)
    if isinstance(key, tuple):
        parts = [b"t", _U32.pack(len(key))]
        for element in key:
            encoded = encode_key(element)
            parts += [_U32.pack(len(encoded)), encoded]
        return b"".join(parts)
    raise StateError(
        f"unsupported key type {type(key).__name__} ({key!r}): use str, int, bytes or a "
        "tuple of those"
    )


def decode_key(data: bytes) -> Key:
    """Inverse of :func:`encode_key` (``bytearray`` keys come back as ``bytes``)."""
    key, end = _decode_key(data, 0, len(data))
    if end != len(data):
        raise StateError(f"trailing bytes after key in {data[:40]!r}")
    return key


def _decode_key(data: bytes, pos: int, end: int) -> tuple[Key, int]:
    if pos >= end:
        raise StateError(f"truncated key bytes {data[:40]!r}")
    tag, body = data[pos : pos + 1], pos + 1
    if tag == b"s":
        return data[body:end].decode("utf-8"), end
    if tag == b"i":
        return int.from_bytes(data[body:end], "big", signed=True), end
    if tag == b"y":
        return bytes(data[body:end]), end
    if tag == b"t":
        (count,) = _U32.unpack_from(data, body)
        pos = body + 4
        elements = []
        for _ in range(count):
            (length,) = _U32.unpack_from(data, pos)
            element, _ = _decode_key(data, pos + 4, pos + 4 + length)
            elements.append(element)
            pos += 4 + length
        if pos > end:
            raise StateError(f"truncated tuple key bytes {data[:40]!r}")
        return tuple(elements), pos
    raise StateError(f"unknown key tag {tag!r} in key bytes {data[:40]!r}")


def check_max_parallelism(max_parallelism: int) -> int:
    if not isinstance(max_parallelism, int) or not (1 <= max_parallelism <= MAX_PARALLELISM_LIMIT):
        raise StateError(
            f"max_parallelism must be an int in 1..{MAX_PARALLELISM_LIMIT}: {max_parallelism!r}"
        )
    return max_parallelism


def check_parallelism(parallelism: int, max_parallelism: int) -> int:
    check_max_parallelism(max_parallelism)
    if not isinstance(parallelism, int) or not (1 <= parallelism <= max_parallelism):
        raise StateError(
            f"parallelism must be an int in 1..max_parallelism={max_parallelism} (each "
            f"instance owns at least one key-group): {parallelism!r}"
        )
    return parallelism


def key_group_of_bytes(key_bytes: bytes, max_parallelism: int) -> int:
    """Key-group of already-canonical key bytes (hot path: no validation of maxP)."""
    return mmh3.hash(key_bytes, 0, signed=False) % max_parallelism


def key_group(key: Key, max_parallelism: int) -> int:
    """``murmur3_32(encode_key(key)) % max_parallelism``."""
    check_max_parallelism(max_parallelism)
    return key_group_of_bytes(encode_key(key), max_parallelism)


@dataclasses.dataclass(frozen=True)
class KeyGroupRange:
    """Key-groups ``start..end``, both inclusive; empty when ``end == start - 1``."""

    start: int
    end: int

    def __post_init__(self) -> None:
        if self.start < 0 or self.end < self.start - 1:
            raise StateError(f"bad key-group range [{self.start}, {self.end}]")

    @classmethod
    def empty(cls) -> KeyGroupRange:
        return cls(0, -1)

    @property
    def is_empty(self) -> bool:
        return self.end < self.start

    def __len__(self) -> int:
        return self.end - self.start + 1

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.start, self.end + 1))

    def __contains__(self, key_group: object) -> bool:
        return isinstance(key_group, int) and self.start <= key_group <= self.end

    def intersection(self, other: KeyGroupRange) -> KeyGroupRange:
        start, end = max(self.start, other.start), min(self.end, other.end)
        return KeyGroupRange(start, end) if start <= end else KeyGroupRange.empty()

    def __str__(self) -> str:
        return "[]" if self.is_empty else f"[{self.start}-{self.end}]"


def key_group_range(max_parallelism: int, parallelism: int, index: int) -> KeyGroupRange:
    """Key-groups of operator ``index`` of ``parallelism`` (formula in the module doc)."""
    check_parallelism(parallelism, max_parallelism)
    if not isinstance(index, int) or not (0 <= index < parallelism):
        raise StateError(f"operator index must be in 0..{parallelism - 1}: {index!r}")
    start = -(-index * max_parallelism // parallelism)  # ceil division
    end = ((index + 1) * max_parallelism - 1) // parallelism
    return KeyGroupRange(start, end)


def operator_index(key_group: int, max_parallelism: int, parallelism: int) -> int:
    """Instance of ``parallelism`` that owns ``key_group``: ``kg * P // maxP``."""
    check_parallelism(parallelism, max_parallelism)
    if not isinstance(key_group, int) or not (0 <= key_group < max_parallelism):
        raise StateError(f"key-group must be in 0..{max_parallelism - 1}: {key_group!r}")
    return key_group * parallelism // max_parallelism


@functools.lru_cache(maxsize=64)
def operator_indexes(max_parallelism: int, parallelism: int) -> tuple[int, ...]:
    """:func:`operator_index` of every key-group, in key-group order: a hot path's lookup
    table (one check of the arguments, not one per record)."""
    check_parallelism(parallelism, max_parallelism)
    return tuple(operator_index(kg, max_parallelism, parallelism) for kg in range(max_parallelism))
