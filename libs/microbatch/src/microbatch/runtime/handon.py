"""One ``process`` call's records handed on to the next keyed step, all at once.

:class:`~microbatch.runtime.router.Router` hands records on one by one: key, placement,
event time and :func:`~microbatch.runtime.envelope.encode_payload` per record, about 2 µs
each in Python. When a call emits a run of dicts with plain keys, the same work is a few
``map`` s over the whole run in C: the same bytes (the codec packs the whole run at once,
value by value only if one of them needs its tagged form), the same placement, the same
event times. Anything that may be a dead letter (a missing or odd key, an event time to
convert, a value the codec refuses) returns None, and the router takes the
record-by-record path, which dead-letters exactly as before and in the same order.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from itertools import repeat
from typing import Any, NamedTuple, cast

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from microbatch.errors import MicrobatchError
from microbatch.keygroup_columns import LIMIT, int_key_groups, key_groups_of
from microbatch.keygroups import encode_key
from microbatch.runtime.envelope import encode_payloads
from microbatch.state.codec_rows import encode_rows

Placed = tuple[bytes, int, int]  # (key bytes, key-group, instance) in the next step
#: Key types whose placement is remembered per value: no two equal values of these
#: types have different key bytes (``1 == 1.0 == True`` would).
_CACHED_KEYS = frozenset({str, int})


class HandedOn(NamedTuple):
    """A run of records ready to become envelope rows, column by column."""

    placed: list[Placed]
    event_ts: list[int | None]
    payloads: list[bytes]


def hand_on(
    records: Sequence[Any],
    key_field: str,
    time_field: str | None,
    windowed: bool,
    known: dict[Any, Placed],
    place: Callable[[bytes], Placed],
    remember: int,
) -> HandedOn | None:
    """``records`` keyed by ``key_field`` for the next step, or None when one of them
    needs the record-by-record path (it may be a dead letter). ``known``: the placement
    of keys seen before (this adds to it while it holds fewer than ``remember``);
    ``place``: a key's placement from its bytes."""
    if set(map(type, records)) != {dict}:
        return None
    keys: list[Any] = list(map(dict.get, records, repeat(key_field)))
    if not set(map(type, keys)) <= _CACHED_KEYS:  # None (missing), float, bool, tuple...
        return None
    found = list(map(known.get, keys))
    if None in found:
        try:
            fresh = {k: place(encode_key(k)) for k in set(keys) if k not in known}
        except MicrobatchError:
            return None
        if len(known) + len(fresh) <= remember:
            known.update(fresh)
        placed = [p if p is not None else fresh[k] for k, p in zip(keys, found, strict=True)]
    else:
        placed = cast("list[Placed]", found)
    if time_field is None:
        # A window's output row carries its time in ``window_end``: the slow path reads it.
        if windowed or any(map(operator.contains, records, repeat("window_end"))):
            return None
        event_ts: list[int | None] = [None] * len(records)
    else:
        event_ts = list(map(dict.get, records, repeat(time_field)))
        if None in event_ts:  # a window's output row: its window's last millisecond
            ends = list(map(dict.get, records, repeat("window_end")))
            event_ts = [
                e - 1 if t is None and type(e) is int else t
                for t, e in zip(event_ts, ends, strict=True)
            ]
        if set(map(type, event_ts)) != {int}:  # missing, or to convert
            return None
    try:
        payloads = encode_payloads(records)
    except MicrobatchError:  # a value the codec refuses: a dead letter
        return None
    return HandedOn(placed, event_ts, payloads)


class ColumnsHandedOn(NamedTuple):
    """A table of rows ready to become envelope rows (:func:`hand_on_columns`)."""

    key: pa.Array  # the next step's key bytes
    key_group: np.ndarray  # and key-groups
    event_ts: pa.Array
    payloads: pa.Array


def hand_on_columns(
    table: pa.Table, key_field: str, time_field: str | None, max_parallelism: int
) -> ColumnsHandedOn | None:
    """A window's output rows (``table``: ``key``, ``window_start``, ``window_end`` and
    its results) keyed by ``key_field`` for the next step, as :func:`hand_on` would hand
    on ``table.to_pylist()`` — or None when a row may be a dead letter (a null or odd
    key, an event time to convert), for the record-by-record path. A row's event time
    is ``time_field``'s value, else its window's last millisecond."""
    if key_field not in table.column_names:
        return None
    placed = key_placements(table.column(key_field), max_parallelism)
    if placed is None:
        return None
    last_ms = pc.subtract(table.column("window_end"), 1)
    if time_field is not None and time_field in table.column_names:
        given = table.column(time_field)
        if not pa.types.is_integer(given.type):
            return None
        try:
            last_ms = pc.coalesce(given.cast(pa.int64()), last_ms)
        except pa.ArrowInvalid:  # a uint64 beyond int64
            return None
    try:
        payloads = encode_rows(table)
    except MicrobatchError:  # a value the codec refuses: a dead letter
        return None
    key, groups = placed
    return ColumnsHandedOn(key, groups, last_ms.combine_chunks(), payloads)


def key_placements(
    column: pa.ChunkedArray, max_parallelism: int
) -> tuple[pa.Array, np.ndarray] | None:
    """``encode_key`` and the key-group of every value of a key column — ints at once,
    strings and bytes once per distinct value — or None when a value is not a key
    (null, bool, float...) or an int is too large for the column-wise encoding."""
    if column.null_count:
        return None
    kind = column.type
    if pa.types.is_integer(kind):
        try:
            ints = column.cast(pa.int64()).to_numpy()
        except pa.ArrowInvalid:
            return None
        if len(ints) and (int(ints.max()) >= LIMIT or int(ints.min()) <= -LIMIT):
            return None
        return int_key_groups(ints, max_parallelism)
    if not (
        pa.types.is_string(kind) or pa.types.is_large_string(kind)
        or pa.types.is_binary(kind) or pa.types.is_large_binary(kind)
    ):  # fmt: skip
        return None
    coded = column.combine_chunks().dictionary_encode()
    distinct, groups = key_groups_of(coded.dictionary, max_parallelism)
    return distinct.take(coded.indices), groups[coded.indices.to_numpy(zero_copy_only=False)]
