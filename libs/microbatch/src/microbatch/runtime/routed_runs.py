"""A run of one topic's records through a dataflow graph's routes in stage 1, all at once.

:meth:`~microbatch.runtime.stage_one.StageOne.add_records` routes a record at a time:
per record and route its stateless chain, key, placement, event time and payload, ~4 µs
per row in Python, which a source feeding two keyed steps pays twice. When every record
of a run (a task's enrichment results, or a batch's decoded records) takes every route
without a doubt, the same rows come from a few ``map`` s per route, and routes that
branch after the same steps run those steps and pack the payloads once. Anything that may
be a dead letter or fail the batch — a step that raises, a key that is missing or of
another type than ``str``/``int``, an event time missing, to convert or late, a value the
codec refuses — returns None: the caller takes the record-by-record path, which decides
exactly as before, in the same order. A route into a window that only sources feed gives
the window's partials instead of its records (:mod:`.graph_partials`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from itertools import repeat
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from microbatch.errors import MicrobatchError
from microbatch.runtime.decoding import MAX_EPOCH_MS, MIN_EPOCH_MS
from microbatch.runtime.envelope import RECORD, encode_payloads
from microbatch.runtime.graph_partials import counted_rows
from microbatch.runtime.steps import Chain, StepFailed, run_chain

if TYPE_CHECKING:
    from microbatch.runtime.stage_one import _Route

Placed = tuple[bytes, int, int]  # (key bytes, key-group, instance)
#: Key types placed by value: no two equal values of these types have different key bytes.
_CACHED_KEYS = frozenset({str, int})


def routed_rows(
    routes: Sequence[_Route],
    topic: str,
    parts: Sequence[int],
    offs: Sequence[int],
    seqs: Sequence[int],
    records: Sequence[Any],
    *,
    time_field: str | None,
    known: dict[Any, Placed],
    place: Callable[[Any], Placed],
    counted: list[pa.RecordBatch],
) -> list[tuple[Any, ...]] | None:
    """The envelope rows of ``records`` (record ``j`` read at ``parts[j]``/``offs[j]``,
    the ``seqs[j]``-th result of its source record) along every route, or None when one
    of them needs the record-by-record path. ``known``: placements of keys seen before
    (added to); ``place``: a new key's placement. A route into a window that stage 1
    reduces (:mod:`.graph_partials`) gives ``partial`` rows, and appends to ``counted``
    the rows its records count as in the ``stat`` rows."""
    by_chain: dict[tuple[int, ...], list[_Route]] = {}
    for route in routes:
        if route.field is None:  # a key function: user code, per record
            return None
        by_chain.setdefault(tuple(map(id, route.edge.chain)), []).append(route)
    rows: list[tuple[Any, ...]] = []
    for same_chain in by_chain.values():
        through = _through(same_chain[0].edge.chain, records)
        if through is None:
            return None
        kept, at, sub = through
        if not kept:
            continue
        if set(map(type, kept)) != {dict}:
            return None
        event_ts = _event_times(kept, time_field)
        if event_ts is None:
            return None
        payloads: list[bytes] | None = None  # packed once, for the routes that take records
        kept_parts = [parts[j] for j in at]
        kept_offs = [offs[j] for j in at]
        kept_seqs = [seqs[j] * 1024 + i for j, i in zip(at, sub, strict=True)]
        for route in same_chain:
            late = route.late_before
            if late is not None and time_field is not None and min(event_ts) < late:
                return None
            placed = _placements(kept, route.field, known, place)  # type: ignore[arg-type]
            if placed is None:
                return None
            marked = topic if route.marker is None else route.marker
            key_bytes, groups, instances = zip(*placed, strict=True)
            if route.reduce is not None:  # a window's records as partials
                partials = route.reduce.of_records(marked, kept, key_bytes, groups, event_ts,
                                                   kept_parts, kept_offs)  # fmt: skip
                if partials is None:
                    return None
                rows.extend(partials)
                counted.append(counted_rows(marked, kept_parts, kept_offs, event_ts))
                continue
            if payloads is None:
                try:
                    payloads = encode_payloads(kept)
                except MicrobatchError:
                    return None
            rows.extend(
                zip(repeat(RECORD), repeat(marked), kept_parts, kept_offs, kept_seqs,
                    instances, groups, key_bytes, event_ts, payloads)
            )  # fmt: skip
    return rows


def _through(chain: Chain, records: Sequence[Any]) -> tuple[list[Any], list[int], list[int]] | None:
    """What ``records`` become after ``chain``: the results, each one's record index and
    its place among that record's results; None if a step raises."""
    if not chain:
        return list(records), list(range(len(records))), [0] * len(records)
    kept: list[Any] = []
    at: list[int] = []
    sub: list[int] = []
    for j, record in enumerate(records):
        try:
            results = run_chain(chain, record)
        except StepFailed:
            return None
        for i, r in enumerate(results):
            kept.append(r)
            at.append(j)
            sub.append(i)
    return kept, at, sub


def _event_times(records: list[dict[str, Any]], field: str | None) -> list[Any] | None:
    """Each record's event time, when all are epoch-ms ints in range; None otherwise."""
    if field is None:
        return [None] * len(records)
    times: list[Any] = list(map(dict.get, records, repeat(field)))
    if set(map(type, times)) != {int}:  # missing, or a string or float to convert
        return None
    if min(times) < MIN_EPOCH_MS or max(times) > MAX_EPOCH_MS:
        return None
    return times


def _placements(
    records: list[dict[str, Any]],
    field: str,
    known: dict[Any, Placed],
    place: Callable[[Any], Placed],
) -> list[Placed] | None:
    keys = list(map(dict.get, records, repeat(field)))
    if not set(map(type, keys)) <= _CACHED_KEYS:  # None (missing), float, bool, tuple...
        return None
    found = list(map(known.get, keys))
    if None not in found:
        return found  # type: ignore[return-value]
    try:
        for key in set(keys).difference(known):
            known[key] = place(key)
    except MicrobatchError:
        return None
    return list(map(known.__getitem__, keys))
