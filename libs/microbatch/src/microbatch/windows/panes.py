"""Hopping windows reduced per *pane* first: the records of one ``every``-wide slice of
event time all fall in the same ``size / every`` windows, so one partial per (key, pane)
stands for them all, and a window is the merge of its panes.

A hopping window of 10 s every 2 s puts each record in 5 windows; aggregating per
(key, window) directly groups 5 rows per record. Per pane, a batch's records are grouped
once, each pane partial is repeated into its windows (:func:`windows_of_panes`) and the
copies merged (:func:`~microbatch.windows.aggregate.merge_table`) — in stage 1 only the
pane partials cross the exchange (fewer rows than per window whenever a key has several
records per pane), and stage 2 repeats them into windows. A partial's row says what it
covers: ``[START, END)`` of its pane or of its window.

Only where merging partials gives what one pass over the records gives, to the bit
(:func:`pane_ms`): aggregates that merge column-wise and sum no floating-point column (a
float sum depends on the order of its terms), and ``size`` a multiple of ``every`` (else
panes would be ``gcd(size, every)`` wide, often too thin to gain anything).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pyarrow as pa

from microbatch.windows.aggregate import END, START, Aggregate, mergeable
from microbatch.windows.spec import Hopping, WindowSpec


def pane_ms(spec: WindowSpec, aggregates: Sequence[Aggregate], schema: pa.Schema) -> int | None:
    """The pane width (``every``) when ``spec``'s windows are reduced per pane for records
    of ``schema``, else None (tumbling and session windows, aggregates that do not merge
    column-wise, a float sum, a size that is not a multiple of ``every``)."""
    if not isinstance(spec, Hopping) or spec.size_ms == spec.every_ms:
        return None
    if spec.size_ms % spec.every_ms or not mergeable(aggregates):
        return None
    for a in aggregates:
        for column, fn in a.needs():
            floating = column in schema.names and pa.types.is_floating(schema.field(column).type)
            if fn == "sum" and floating:
                return None
    return spec.every_ms


def windows_of_panes(partial: pa.Table, spec: Hopping) -> pa.Table:
    """A table of partials whose rows cover panes or windows (``[START, END)``) as one
    row per (row, window): a pane's row repeated into each window that holds the pane,
    with that window's start; a window's row as it is. Without :data:`END`; the rows of
    one (key, window) still to merge."""
    start = partial.column(START).to_numpy(zero_copy_only=False).astype(np.int64)
    end = partial.column(END).to_numpy(zero_copy_only=False).astype(np.int64)
    partial = partial.drop_columns([END])
    is_pane = end - start < spec.size_ms
    if not is_pane.any():
        return partial
    hops = spec.size_ms // spec.every_ms  # windows per pane: [p - size + every, p] by every
    panes = np.flatnonzero(is_pane)
    whole = np.flatnonzero(~is_pane)
    rows = np.concatenate([whole, np.repeat(panes, hops)])
    back = spec.every_ms * np.arange(hops, dtype=np.int64)
    starts = np.concatenate([start[whole], (start[panes, None] - back[None, :]).ravel()])
    taken = partial.take(pa.array(rows, pa.int64()))
    return taken.set_column(
        taken.schema.get_field_index(START), START, pa.array(starts, pa.int64())
    )
