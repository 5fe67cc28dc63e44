"""A key's whole state as one value: the unit of point access in sorted runs.

A batch touches a key and needs *all* of its state — every value, list and map state and
its timers — so a run stores one entry per key: its rows
(:meth:`~microbatch.state.backend.KeyedStateBackend.export_key`, without the key) encoded
with the state codec, which is already fixed-format and pickle-free. An empty bundle is a
deletion (the key has no state left), stored as a null value in the run.

Runs hold two kinds of entries, told apart by the byte after the key-group:

- ``kg | "k" | key bytes`` → the key's bundle (:func:`state_key`);
- ``kg | "t" | timestamp (8 bytes, offset so that order is numeric) | key bytes`` → an
  empty value, or null once the timer is gone (:func:`timer_key`): an index of timers by
  time per key-group, so due timers are found by reading one key range per key-group
  instead of every key's state;
- ``kg | "p" | timestamp | key bytes``: the same index of processing-time timers.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from microbatch.errors import CheckpointError
from microbatch.state.codec import CodecError, decode_value, encode_value, encode_values
from microbatch.state.engine.runs import composite, split

Row = tuple[Any, ...]
STATE, TIMER, PROCESSING_TIMER = b"k", b"t", b"p"
_TS_OFFSET = 1 << 63  # signed ms → unsigned, so byte order is time order


def state_key(key_group: int, key_bytes: bytes) -> bytes:
    return composite(key_group, STATE + key_bytes)


def timer_key(key_group: int, timestamp: int, key_bytes: bytes, kind: bytes = TIMER) -> bytes:
    return composite(key_group, kind + (timestamp + _TS_OFFSET).to_bytes(8, "big") + key_bytes)


def timers_until(key_group: int, watermark: int, kind: bytes = TIMER) -> tuple[bytes, bytes]:
    """``[lo, hi)`` of the timer entries of ``key_group`` with timestamp <= ``watermark``
    (``kind``: :data:`PROCESSING_TIMER` for processing-time timers)."""
    return composite(key_group, kind), composite(
        key_group, kind + (watermark + 1 + _TS_OFFSET).to_bytes(8, "big")
    )


def parse_timer_key(sort_key: bytes) -> tuple[int, int, bytes]:
    """(key-group, timestamp, key bytes) of a timer entry's sort key."""
    kg, rest = split(sort_key)
    return kg, int.from_bytes(rest[1:9], "big") - _TS_OFFSET, rest[9:]


def encode_bundle(rows: Sequence[Row]) -> bytes | None:
    """The run value of a key with ``rows``; None (a deletion) when it has none."""
    if not rows:
        return None
    return encode_value([list(r) for r in rows])


def value_bundles(name: str, stored: Sequence[tuple[bytes, int | None]]) -> list[bytes]:
    """The run values of keys whose whole state is value state ``name``, holding the
    ``stored`` (encoded value, expiry) pairs: :func:`encode_bundle` of their rows, made
    without exporting them key by key."""
    return encode_values([[[name, "value", None, data, expires, None]] for data, expires in stored])


def decode_bundle(data: bytes, where: str) -> list[Row]:
    """The rows of a key from its run value; ``where`` names run and key in errors."""
    try:
        rows = decode_value(data)
    except CodecError as e:
        raise CheckpointError(f"{where}: the key's state cannot be decoded ({e})") from e
    if not isinstance(rows, list) or not all(isinstance(r, list) and len(r) == 6 for r in rows):
        raise CheckpointError(f"{where}: the key's state is not a list of 6-field rows")
    return [tuple(r) for r in rows]
