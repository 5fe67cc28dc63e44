"""Window aggregations: a batch's rows reduced column-wise, merged into what earlier
batches left, finished when the window closes.

Each aggregation is three steps, so a window can span any number of batches:

1. **partial** — one batch's rows of one (key, window), reduced by an Arrow group-by in
   C++ (``sum``, ``count_all``, ``min``, ``max``, ``first``, ``last``, ``list``), or by the
   user's ``add`` for a :class:`Custom` aggregate (the only per-record Python);
2. **merge** — the partial kept in window state (older) with the batch's (newer);
3. **result** — the output value once the window is emitted.

Partials are plain data (ints, floats, lists, tuples), so they live in keyed state as they
are. ``first`` and ``last`` are by event time, ties by source order (topic, partition,
offset), and take the earliest (latest) record's value even when it is null: the same
input gives the same output however it was split into batches.

The group-by's output is itself a table of partials (:func:`partial_table`); when every
aggregate's Arrow functions merge column-wise (:func:`mergeable`: count, sum, min, max,
mean, first, last), tables of partials from several places — stage 1's tasks, before the
exchange — merge into one row per (key, window) with another group-by
(:func:`merge_table`), so only partials cross the shuffle. ``collect`` and custom
aggregates merge too, but not column-wise (:mod:`microbatch.windows.python_merge`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from microbatch.errors import ConfigError
from microbatch.state.codec import decode_value

#: Columns the window operator adds before aggregating (see :func:`partials`).
KEY, START, TS, ORDER = "__key", "__window_start", "__ts", "__order"
#: A session fragment's end (sessions only: a tumbling or hopping window's end is known).
END = "__window_end"
#: The earliest record of a partial (event time, source order): every partial table has
#: them, so partials of one (key, window) merge in an order that does not depend on the
#: order they arrive in (a float sum gives the same bits on every rerun).
FIRST_TS, FIRST_ORDER = f"{TS}_first", f"{ORDER}_first"
#: Prefix of a partial table's column holding a custom aggregate's encoded accumulator.
ACC = "__acc"
#: How each Arrow hash aggregate's output merges with another's of the same (key, window).
_MERGE = {"count": "sum", "sum": "sum", "min": "min", "max": "max", "first": "first",
          "last": "last"}  # fmt: skip
#: Earliest / latest by record, null or not (Arrow's default skips nulls).
_WHOLE_RECORD = pc.ScalarAggregateOptions(skip_nulls=False)


@dataclasses.dataclass(frozen=True)
class Aggregate:
    """One output column of a window."""

    name: str
    column: str | None = None

    def needs(self) -> list[tuple[str, str]]:
        """(column, Arrow hash aggregate) pairs this aggregation reads from the group-by."""
        raise NotImplementedError

    def partial(self, row: Mapping[str, Any]) -> Any:
        """The batch's partial from its group-by output row."""
        raise NotImplementedError

    def merge(self, older: Any, newer: Any) -> Any:
        raise NotImplementedError

    def result(self, partial: Any) -> Any:
        return partial

    def result_column(self, merged: pa.Table) -> pa.Array | pa.ChunkedArray | None:
        """The results of a table of partials with one row per window, column by column
        (what :meth:`result` of :meth:`partial` gives each row); None: only per window."""
        return None

    def _col(self, fn: str) -> str:
        return f"{self.column}_{fn}"


class Count(Aggregate):
    def needs(self) -> list[tuple[str, str]]:
        return [(TS, "count")]  # TS is never null: every row counts

    def partial(self, row: Mapping[str, Any]) -> Any:
        return row[f"{TS}_count"]

    def merge(self, older: Any, newer: Any) -> Any:
        return older + newer

    def result_column(self, merged: pa.Table) -> pa.ChunkedArray:
        return merged.column(f"{TS}_count")


class Sum(Aggregate):
    def needs(self) -> list[tuple[str, str]]:
        return [(str(self.column), "sum")]

    def partial(self, row: Mapping[str, Any]) -> Any:
        return row[self._col("sum")]

    def result_column(self, merged: pa.Table) -> pa.ChunkedArray:
        return merged.column(self._col("sum"))

    def merge(self, older: Any, newer: Any) -> Any:
        return newer if older is None else older if newer is None else older + newer


class Min(Aggregate):
    def needs(self) -> list[tuple[str, str]]:
        return [(str(self.column), "min")]

    def partial(self, row: Mapping[str, Any]) -> Any:
        return row[self._col("min")]

    def result_column(self, merged: pa.Table) -> pa.ChunkedArray:
        return merged.column(self._col("min"))

    def merge(self, older: Any, newer: Any) -> Any:
        return newer if older is None else older if newer is None else min(older, newer)


class Max(Aggregate):
    def needs(self) -> list[tuple[str, str]]:
        return [(str(self.column), "max")]

    def partial(self, row: Mapping[str, Any]) -> Any:
        return row[self._col("max")]

    def result_column(self, merged: pa.Table) -> pa.ChunkedArray:
        return merged.column(self._col("max"))

    def merge(self, older: Any, newer: Any) -> Any:
        return newer if older is None else older if newer is None else max(older, newer)


class Mean(Aggregate):
    """Partial: [sum, count of non-null values]."""

    def needs(self) -> list[tuple[str, str]]:
        return [(str(self.column), "sum"), (str(self.column), "count")]

    def partial(self, row: Mapping[str, Any]) -> Any:
        return [row[self._col("sum")] or 0, row[self._col("count")]]

    def merge(self, older: Any, newer: Any) -> Any:
        return [older[0] + newer[0], older[1] + newer[1]]

    def result(self, partial: Any) -> Any:
        return partial[0] / partial[1] if partial[1] else None

    def result_column(self, merged: pa.Table) -> pa.Array:
        sums = merged.column(self._col("sum")).to_pylist()
        counts = merged.column(self._col("count")).to_pylist()
        return pa.array([(s or 0) / c if c else None for s, c in zip(sums, counts, strict=True)])


class First(Aggregate):
    """Partial: [event time, source order, value] of the earliest record."""

    def needs(self) -> list[tuple[str, str]]:
        return [(TS, "first"), (ORDER, "first"), (str(self.column), "first")]

    def partial(self, row: Mapping[str, Any]) -> Any:
        return [row[f"{TS}_first"], row[f"{ORDER}_first"], row[self._col("first")]]

    def result_column(self, merged: pa.Table) -> pa.ChunkedArray:
        return merged.column(self._col("first"))

    def merge(self, older: Any, newer: Any) -> Any:
        return older if tuple(older[:2]) <= tuple(newer[:2]) else newer

    def result(self, partial: Any) -> Any:
        return partial[2]


class Last(Aggregate):
    """Partial: [event time, source order, value] of the latest record."""

    def needs(self) -> list[tuple[str, str]]:
        return [(TS, "last"), (ORDER, "last"), (str(self.column), "last")]

    def partial(self, row: Mapping[str, Any]) -> Any:
        return [row[f"{TS}_last"], row[f"{ORDER}_last"], row[self._col("last")]]

    def result_column(self, merged: pa.Table) -> pa.ChunkedArray:
        return merged.column(self._col("last"))

    def merge(self, older: Any, newer: Any) -> Any:
        return newer if tuple(newer[:2]) >= tuple(older[:2]) else older

    def result(self, partial: Any) -> Any:
        return partial[2]


class Collect(Aggregate):
    """Partial: [[event time, source order, value], ...]; the result is the values in
    event-time order."""

    def needs(self) -> list[tuple[str, str]]:
        return [(TS, "list"), (ORDER, "list"), (str(self.column), "list")]

    def partial(self, row: Mapping[str, Any]) -> Any:
        return [
            list(e)
            for e in zip(
                row[f"{TS}_list"], row[f"{ORDER}_list"], row[self._col("list")], strict=True
            )
        ]

    def merge(self, older: Any, newer: Any) -> Any:
        return sorted(older + newer, key=lambda e: (e[0], e[1]))

    def result(self, partial: Any) -> Any:
        return [e[2] for e in partial]


@dataclasses.dataclass(frozen=True)
class Custom(Aggregate):
    """A user aggregate: ``init() -> acc``, ``add(acc, value) -> acc`` per record (in
    event-time order, ties by source order), ``combine(older, newer) -> acc``,
    ``finish(acc) -> value``. The accumulator must be plain data (it is stored in keyed
    state and crosses the exchange, encoded by :mod:`microbatch.state.codec`).

    The contract, as for Flink's ``AggregateFunction.merge``: ``combine`` agrees with
    ``add`` — ``combine(fold(a), fold(b)) == fold(a + b)`` for any two runs of records ``a``
    and ``b``, where ``fold`` is ``add`` from ``init()`` — and is associative; and, as
    records may be split any way, commutative. A window's records reach it in batches:
    each batch's are folded in one run, in event-time order, then combined with the state.
    With ``pre_aggregate=True`` (opt-in) they also reach it in stage-1 tasks: each task's
    records are folded before the exchange, and the tasks' accumulators combined in the
    order of their earliest records, then with the state. Records of two tasks interleave
    in event time, so only an aggregate that does not depend on the order of its records
    (a count, an integer sum, a min, a set, a top-k with ties broken by value) gives the
    same result for every split; one that does (values concatenated in order, a
    floating-point sum to the bit) keeps the default, and every record is shuffled.
    """

    init: Callable[[], Any] | None = None
    add: Callable[[Any, Any], Any] | None = None
    combine: Callable[[Any, Any], Any] | None = None
    finish: Callable[[Any], Any] | None = None
    #: May stage 1 fold the records before the exchange (:func:`pre_aggregable`)? Only
    #: for an order-insensitive aggregate (the contract above): opt-in.
    pre_aggregate: bool = False

    def __post_init__(self) -> None:
        missing = [n for n in ("init", "add", "combine", "finish") if getattr(self, n) is None]
        if missing:
            raise ConfigError(f"custom window aggregate {self.name!r} needs {', '.join(missing)}")

    @property
    def encoded(self) -> str:
        """The partial table's column of this aggregate's encoded accumulators."""
        return f"{ACC}_{self.name}"

    def needs(self) -> list[tuple[str, str]]:
        return [(str(self.column), "list")]

    def partial(self, row: Mapping[str, Any]) -> Any:
        if self.encoded in row:  # folded before the exchange
            return decode_value(row[self.encoded])
        return self.fold(row[self._col("list")])

    def fold(self, values: Sequence[Any]) -> Any:
        """``add`` over ``values``, in order, from ``init()``."""
        acc = self.init()  # type: ignore[misc]
        for value in values:
            acc = self.add(acc, value)  # type: ignore[misc]
        return acc

    def merge(self, older: Any, newer: Any) -> Any:
        return self.combine(older, newer)  # type: ignore[misc]

    def result(self, partial: Any) -> Any:
        return self.finish(partial)  # type: ignore[misc]


def check_aggregates(aggregates: Sequence[Aggregate], columns: Sequence[str] | None) -> None:
    """Refuse duplicate output names and (when the input columns are declared) unknown
    columns, when the pipeline is built."""
    names = [a.name for a in aggregates]
    duplicated = sorted({n for n in names if names.count(n) > 1})
    if duplicated:
        raise ConfigError(f"window aggregates with the same output name: {duplicated}")
    for a in aggregates:
        if not isinstance(a, Count) and not a.column:
            raise ConfigError(f"window aggregate {a.name!r} needs a column")
        if columns is not None and a.column is not None and a.column not in columns:
            raise ConfigError(
                f"window aggregate {a.name!r} reads column {a.column!r}, which the declared "
                f"schema does not have (columns: {sorted(columns)})"
            )


def mergeable(aggregates: Sequence[Aggregate]) -> bool:
    """Do the aggregates' partials merge column-wise (:func:`merge_table`)? ``collect``
    and custom aggregates keep Python values per record or per partial: they do not."""
    return all(fn in _MERGE for a in aggregates for _, fn in a.needs())


def pre_aggregable(aggregates: Sequence[Aggregate]) -> bool:
    """May partials of parts of a batch's records (stage 1's tasks) be merged into what
    one pass over all of them gives? Column-wise ones (:func:`mergeable`), ``collect``
    (its partial keeps every record with its event time and source order) and custom
    aggregates that opt in (their contract: :class:`Custom`)."""
    return all(
        mergeable([a]) or isinstance(a, Collect) or (isinstance(a, Custom) and a.pre_aggregate)
        for a in aggregates
    )


def arrow_needs(
    aggregates: Sequence[Aggregate], carry: Sequence[tuple[str, str]] = ()
) -> list[tuple[str, str]]:
    """The (column, Arrow aggregate function) pairs that the partials of ``aggregates``
    (and ``carry``) are computed from, each once, in a fixed order."""
    return sorted({*(n for a in aggregates for n in a.needs()), *carry})


def _with_options(needs: Sequence[tuple[str, str]]) -> list[tuple[Any, ...]]:
    return [(c, fn, _WHOLE_RECORD) if fn in ("first", "last") else (c, fn) for c, fn in needs]


def partial_table(
    table: pa.Table, aggregates: Sequence[Aggregate], carry: Sequence[tuple[str, str]] = ()
) -> pa.Table:
    """One table's partials: a row per (:data:`KEY`, :data:`START`), a column
    ``<column>_<function>`` per Arrow aggregate the aggregates need (and per ``carry``),
    plus :data:`FIRST_TS` and :data:`FIRST_ORDER`. ``table`` has the columns :data:`KEY`,
    :data:`START`, :data:`TS` (event time, ms), :data:`ORDER` (the record's source order,
    comparable across batches) and the aggregated columns."""
    needs = arrow_needs(aggregates, [*carry, (TS, "first"), (ORDER, "first")])
    ordered = table.sort_by(
        [(KEY, "ascending"), (START, "ascending"), (TS, "ascending"), (ORDER, "ascending")]
    )
    grouped = ordered.group_by([KEY, START], use_threads=False)  # keeps the order
    return grouped.aggregate(_with_options(needs))


def merge_table(
    table: pa.Table, aggregates: Sequence[Aggregate], carry: Sequence[tuple[str, str]] = ()
) -> pa.Table:
    """Tables of partials (:func:`partial_table`'s, concatenated in any order) merged into
    one row per (key, window), named as :func:`partial_table` names them: what one
    group-by over all their records would give. Needs :func:`mergeable` aggregates."""
    needs = arrow_needs(aggregates, [*carry, (TS, "first"), (ORDER, "first")])
    late_cols = [f"{c}_{fn}" for c, fn in needs if fn == "last"]
    early = [(f"{c}_{fn}", _MERGE[fn]) for c, fn in needs if fn != "last"]
    by_first = table.sort_by(
        [(KEY, "ascending"), (START, "ascending"), (FIRST_TS, "ascending"),
         (FIRST_ORDER, "ascending")]
    )  # fmt: skip
    merged = by_first.group_by([KEY, START], use_threads=False).aggregate(_with_options(early))
    named = {f"{name}_{fn}": name for name, fn in early}
    merged = merged.rename_columns([named.get(c, c) for c in merged.column_names])
    if late_cols:  # latest record of all: ordered by each partial's latest
        by_last = table.sort_by(
            [(KEY, "ascending"), (START, "ascending"), (f"{TS}_last", "ascending"),
             (f"{ORDER}_last", "ascending")]
        )  # fmt: skip
        grouped = by_last.group_by([KEY, START], use_threads=False)
        latest = grouped.aggregate(_with_options([(c, "last") for c in late_cols]))
        for name in late_cols:  # groups in (key, start) order in both: rows align
            merged = merged.append_column(name, latest.column(f"{name}_last"))
    return merged


def partial_values(
    table: pa.Table, aggregates: Sequence[Aggregate]
) -> dict[tuple[Any, int], list[Any]]:
    """Each (key, window start)'s partials as plain data, from a table of partials."""
    out: dict[tuple[Any, int], list[Any]] = {}
    for row in table.to_pylist():
        out[row[KEY], row[START]] = [a.partial(row) for a in aggregates]
    return out


def partials(table: pa.Table, aggregates: Sequence[Aggregate]) -> dict[tuple[Any, int], list[Any]]:
    """One batch's partial of every aggregate per (key, window start) (``table``: as for
    :func:`partial_table`)."""
    return partial_values(partial_table(table, aggregates), aggregates)


def merge_partials(
    aggregates: Sequence[Aggregate], older: Sequence[Any] | None, newer: Sequence[Any]
) -> list[Any]:
    if older is None:
        return list(newer)
    return [a.merge(o, n) for a, o, n in zip(aggregates, older, newer, strict=True)]


def results(aggregates: Sequence[Aggregate], partial: Sequence[Any]) -> dict[str, Any]:
    return {a.name: a.result(p) for a, p in zip(aggregates, partial, strict=True)}
