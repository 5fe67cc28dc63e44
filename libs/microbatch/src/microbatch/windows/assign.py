"""Which windows each record falls in, for a whole column of event times at once.

Stage 2 gets a batch's records as Arrow columns; assigning windows with numpy costs a few
nanoseconds per record instead of a Python call. Results are *pairs*: for hopping windows
one record yields several (record, window) rows, so every function returns the record
indices and window starts as parallel arrays, ready for ``Table.take`` and a group-by.

All times are epoch milliseconds (int64); floor division keeps windows aligned for times
before 1970 too.
"""

from __future__ import annotations

import numpy as np

from microbatch.windows.spec import Hopping, Tumbling


def tumbling(ts: np.ndarray, spec: Tumbling) -> tuple[np.ndarray, np.ndarray]:
    """(record index, window start) of each record: exactly one window each."""
    ts = np.asarray(ts, dtype=np.int64)
    return np.arange(len(ts)), ts - np.mod(ts, spec.size_ms)


def hopping(ts: np.ndarray, spec: Hopping) -> tuple[np.ndarray, np.ndarray]:
    """(record index, window start) pairs: every window ``[s, s + size)`` with ``s`` a
    multiple of ``every`` that holds the record; ordered by record, then start."""
    ts = np.asarray(ts, dtype=np.int64)
    latest = ts - np.mod(ts, spec.every_ms)  # the newest window start <= ts
    hops = -(-spec.size_ms // spec.every_ms)  # ceil: the most windows a record can be in
    starts = latest[:, None] - spec.every_ms * np.arange(hops)[None, :]
    inside = starts > (ts - spec.size_ms)[:, None]  # s + size > ts
    rows, cols = np.nonzero(inside)
    return rows, starts[rows, cols]


def sessions(
    keys: np.ndarray, ts: np.ndarray, gap_ms: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Sessions within one batch: ``(session id per record, session starts, session
    ends)``, ids numbered in (key, start) order. Records of a key whose windows
    ``[ts, ts + gap)`` overlap or touch — the next record comes no later than the previous
    one's window ends, as Spark's ``session_window`` merges them — share a session, which
    ends ``gap`` after its last record. ``keys`` must be
    sortable (bytes or ints); merging with sessions of earlier batches is the caller's."""
    ts = np.asarray(ts, dtype=np.int64)
    n = len(ts)
    if n == 0:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty, empty
    order = np.lexsort((ts, keys))
    k, t = np.asarray(keys)[order], ts[order]
    new_key = np.ones(n, dtype=bool)
    new_key[1:] = k[1:] != k[:-1]
    # t is sorted within a key, so the running end of the session so far is previous + gap
    gap_break = np.ones(n, dtype=bool)
    gap_break[1:] = t[1:] > t[:-1] + gap_ms
    opens = new_key | gap_break
    sid_sorted = np.cumsum(opens) - 1
    ids = np.empty(n, dtype=np.int64)
    ids[order] = sid_sorted
    starts = t[opens]
    last = np.maximum.reduceat(t, np.flatnonzero(opens))
    return ids, starts, last + gap_ms
