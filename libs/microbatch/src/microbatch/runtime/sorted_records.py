"""An instance's records in processing order: by key bytes, then by source position.

A keyed step calls ``process(key, records)`` per key in key-byte order, each key's records
in the order they had at their source (topic, partition, offset, then their place among
one record's outputs), so a rerun makes the same calls in the same order.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from microbatch.runtime.envelope import RECORD
from microbatch.runtime.steps import FOR

#: The order a batch's rows have at their source.
SOURCE_ORDER = ("topic", "partition", "offset", "seq")


class SortedRecords:
    """The ``record`` rows of an instance's table in processing order — key bytes, then
    source order — as row indices into the table; a column is taken in that order only
    when asked for (a key's fields are taken when ``process()`` reads its records).

    Sorted on ranks, not on the bytes themselves: each distinct key (and topic) is ranked
    among the distinct ones and the rows are sorted by integers — the same order as
    sorting on the binary columns, several times faster."""

    def __init__(self, table: pa.Table) -> None:
        self.table = table
        mask = pc.equal(table.column("kind"), RECORD)
        order = table.select(["key", *SOURCE_ORDER]).filter(mask)
        ranks = pa.table(
            {
                "key": _ranks(order.column("key")),
                "topic": _ranks(order.column("topic")),
                **{c: order.column(c) for c in SOURCE_ORDER[1:]},
            }
        )
        by = pc.sort_indices(ranks, sort_keys=[(c, "ascending") for c in ("key", *SOURCE_ORDER)])
        self.rows = pc.indices_nonzero(mask).take(by)
        self.num_rows = len(self.rows)
        self._taken: dict[str, pa.ChunkedArray] = {}

    def column(self, name: str) -> pa.ChunkedArray:
        if name not in self._taken:
            self._taken[name] = self.table.column(name).take(self.rows)
        return self._taken[name]

    def at(self, name: str, positions: pa.Array) -> pa.Array | pa.ChunkedArray:
        """Column ``name`` at the given positions of the processing order only."""
        return self.table.column(name).take(self.rows.take(positions))

    def select(self, names: list[str]) -> pa.Table:
        return pa.table({name: self.column(name) for name in names})

    def source(self, i: int) -> dict[str, Any]:
        """Topic, partition and offset of the ``i``-th record (for errors)."""
        row = self.rows[i].as_py()
        at = {c: self.table.column(c)[row].as_py() for c in ("topic", "partition", "offset")}
        at["topic"] = at["topic"].split(FOR)[0]  # the source's topic, or ``@<step>``
        return at

    def sides(self, side_of: dict[str, int]) -> list[int]:
        """The input side of each record, in processing order (a join's)."""
        topics = self.column("topic").combine_chunks().dictionary_encode()
        codes = [side_of[t.split(FOR)[0]] for t in topics.dictionary.to_pylist()]
        sides: list[int] = np.array(codes, dtype=np.int64)[topics.indices.to_numpy()].tolist()
        return sides


def _ranks(column: pa.ChunkedArray) -> pa.Array:
    """Each value's place among the column's distinct values, in ascending order."""
    column = column.combine_chunks()
    distinct = pc.unique(column)
    return pc.index_in(column, value_set=distinct.take(pc.sort_indices(distinct)))


def key_runs(keys: pa.ChunkedArray | pa.Array) -> list[tuple[int, int]]:
    """``[start, end)`` of each key's run of rows in a sorted, non-null key column: found
    by Arrow in C (each key compared with the one before), not by a Python scan."""
    n = len(keys)
    if n == 0:
        return []
    if isinstance(keys, pa.ChunkedArray):
        keys = keys.combine_chunks()
    changed = pc.not_equal(keys.slice(1), keys.slice(0, n - 1))
    starts = [0, *(pc.indices_nonzero(changed).to_numpy() + 1).tolist()]
    return list(zip(starts, [*starts[1:], n], strict=True))


def in_source_order(rows: pa.Table) -> pa.Table:
    """``rows`` sorted by source position (:data:`SOURCE_ORDER`), not copied when they
    already are: rows that never crossed an exchange (:mod:`.one_stage`) come in it."""
    order = pc.sort_indices(rows, sort_keys=[(c, "ascending") for c in SOURCE_ORDER])
    if bool((np.diff(order.to_numpy()) == 1).all()):
        return rows
    return rows.take(order)
