"""Partials of ``collect`` and custom aggregates, merged across stage 1's tasks.

Their partials are not columns that a group-by merges (:func:`~microbatch.windows.
aggregate.mergeable`): a custom aggregate's is its accumulator, folded by the user's
``add`` before the exchange and shipped encoded with the state's value codec
(:func:`encode_accumulators`); ``collect``'s is the records' values with their event
times and source order, as Arrow lists. Stage 2 merges them per (key, window) in the
order of each partial's earliest record (:func:`merge_rows`), so the result is what one
pass over all records gives whenever the custom aggregate keeps its contract
(:class:`~microbatch.windows.aggregate.Custom`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from microbatch.state.codec import CodecError, decode_value, encode_value
from microbatch.windows.aggregate import (
    FIRST_ORDER,
    FIRST_TS,
    KEY,
    ORDER,
    START,
    TS,
    Aggregate,
    Collect,
    Custom,
    merge_table,
    mergeable,
    partial_table,
    partial_values,
)

#: No accumulator yet (None may be one).
_NONE = object()


def encode_accumulators(table: pa.Table, aggregates: Sequence[Aggregate]) -> pa.Table:
    """A table of partials (:func:`partial_table`'s) as it crosses the exchange: each
    custom aggregate's records folded into its accumulator, encoded in a binary column
    (:attr:`Custom.encoded`), instead of the records' values (lists no other aggregate
    reads are dropped)."""
    custom = [a for a in aggregates if isinstance(a, Custom)]
    if not custom:
        return table
    for a in custom:
        try:
            accumulators = [encode_value(acc) for acc in _custom_partials(table, a)]
        except CodecError as e:
            raise CodecError(  # the type the records path raises, when it stores state
                f"custom window aggregate {a.name!r}: its accumulator must be plain data "
                f"(it crosses the exchange and is kept in state): {e}; convert it in `add` "
                "and `merge`"
            ) from e
        table = table.append_column(a.encoded, pa.array(accumulators, pa.binary()))
    kept = {f"{c}_{fn}" for a in aggregates if not isinstance(a, Custom) for c, fn in a.needs()}
    return table.drop_columns([a._col("list") for a in custom if a._col("list") not in kept])


def merge_rows(
    table: pa.Table, aggregates: Sequence[Aggregate]
) -> dict[tuple[Any, int], list[Any]]:
    """Tables of partials (:func:`partial_table`'s or :func:`encode_accumulators`',
    concatenated in any order) merged per (key, window), for aggregates that are not all
    :func:`mergeable`: the column-wise ones by :func:`merge_table`, ``collect``'s records
    regrouped by Arrow in event-time order, a custom aggregate's partials with its
    ``merge(older, newer)`` in the order of their earliest records."""
    ordered = table.sort_by(
        [(KEY, "ascending"), (START, "ascending"), (FIRST_TS, "ascending"),
         (FIRST_ORDER, "ascending")]
    )  # fmt: skip
    merged: dict[str, dict[tuple[Any, int], Any]] = {}
    columnwise = [a for a in aggregates if mergeable([a])]
    if columnwise:
        values = partial_values(merge_table(ordered, columnwise), columnwise)
        for i, a in enumerate(columnwise):
            merged[a.name] = {w: v[i] for w, v in values.items()}
    for a in aggregates:
        if isinstance(a, Collect):
            merged[a.name] = _merged_collect(ordered, a)
    keys, starts = ordered.column(KEY).to_pylist(), ordered.column(START).to_pylist()
    windows = list(zip(keys, starts, strict=True))
    for a in aggregates:
        if isinstance(a, Custom):
            accumulators = merged[a.name] = {}
            for window, acc in zip(windows, _custom_partials(ordered, a), strict=True):
                older = accumulators.get(window, _NONE)
                accumulators[window] = acc if older is _NONE else a.merge(older, acc)
    return {w: [merged[a.name][w] for a in aggregates] for w in dict.fromkeys(windows)}


def _custom_partials(table: pa.Table, aggregate: Custom) -> list[Any]:
    """Each row's accumulator: decoded when it crossed the exchange, else folded."""
    if aggregate.encoded in table.column_names:
        return [decode_value(b) for b in table.column(aggregate.encoded).to_pylist()]
    return [aggregate.fold(values) for values in table.column(aggregate._col("list")).to_pylist()]


def _merged_collect(table: pa.Table, aggregate: Collect) -> dict[tuple[Any, int], Any]:
    """``collect``'s partials merged: their records unnested and grouped again, in event
    time and source order — the sorted merge of all of them, in Arrow."""
    lists = [f"{TS}_list", f"{ORDER}_list", aggregate._col("list")]
    table = table.select([KEY, START, *lists]).combine_chunks()
    parents = pc.list_parent_indices(table.column(lists[0]))
    records = pa.table(
        {KEY: table.column(KEY).take(parents), START: table.column(START).take(parents),
         **{c: pc.list_flatten(table.column(c)) for c in lists}}
    )  # fmt: skip
    records = records.rename_columns([KEY, START, TS, ORDER, str(aggregate.column)])
    regrouped = partial_table(records, [aggregate])
    return {w: v[0] for w, v in partial_values(regrouped, [aggregate]).items()}
