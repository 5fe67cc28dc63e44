"""Column-wise steps: ``where`` and ``select`` on a declared schema's Arrow columns.

A source with a declared ``value_schema`` is decoded into Arrow columns in stage 1
(:mod:`.columnar`); these steps run on those columns before anything keys or builds a
record, so a stateless filter or projection costs an Arrow kernel per batch, not a
Python call per record:

- ``where(expr)`` keeps the rows where a :class:`pyarrow.compute.Expression` is true (a
  null is not true: the row is dropped, as SQL's ``WHERE`` drops it);
- ``select(*names, **computed)`` keeps the named columns, in that order, and appends one
  column per computed expression.

Every step is evaluated on an empty table of its input schema when the dataflow is built
(:func:`output_schema`): that is how a step learns its output schema, and how a missing
column, a type error or a ``where`` that is not boolean is refused before any batch runs.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from typing import Literal

import numpy as np
import pyarrow as pa
import pyarrow.acero as acero
import pyarrow.compute as pc

from microbatch.errors import ConfigError

ColumnKind = Literal["where", "select"]

__all__ = ["ColumnStep", "ColumnStepFailed", "columns_read", "output_schema", "run_columns"]


class ColumnStepFailed(Exception):
    """An Arrow kernel of a column step failed on a batch (an overflow in a checked
    multiply, a division by zero): the batch fails, naming the step."""

    def __init__(self, step: str, error: str) -> None:
        super().__init__(f"column step {step!r} failed: {error}")
        self.step = step


@dataclasses.dataclass(frozen=True)
class ColumnStep:
    """One column-wise step. ``where``: ``condition``; ``select``: ``names`` kept, then
    ``computed`` (name, expression) appended. ``name``: how errors name the step."""

    kind: ColumnKind
    name: str
    condition: pc.Expression | None = None
    names: tuple[str, ...] = ()
    computed: tuple[tuple[str, pc.Expression], ...] = ()

    def expressions(self) -> tuple[list[pc.Expression], list[str]]:
        """What the step projects: (expressions, output names)."""
        if self.kind == "where":
            return [self.condition], ["where"]
        exprs = [pc.field(n) for n in self.names] + [e for _, e in self.computed]
        return exprs, [*self.names, *(n for n, _ in self.computed)]

    def fields(self) -> list[str]:
        """The input columns the step names directly (``select``'s kept names)."""
        return list(self.names)


def _project(table: pa.Table, exprs: list[pc.Expression], names: list[str]) -> pa.Table:
    """``exprs`` evaluated on ``table`` (in row order: one thread)."""
    plan = acero.Declaration.from_sequence(
        [
            acero.Declaration("table_source", acero.TableSourceNodeOptions(table)),
            acero.Declaration("project", acero.ProjectNodeOptions(exprs, names)),
        ]
    )
    return plan.to_table(use_threads=False)


def output_schema(steps: Sequence[ColumnStep], schema: pa.Schema, where: str) -> pa.Schema:
    """The schema after ``steps`` on records of ``schema``; raises ConfigError naming the
    step (and the column) that cannot run on it."""
    table = schema.empty_table()
    for step in steps:
        missing = [n for n in step.fields() if n not in table.schema.names]
        if missing:
            raise ConfigError(
                f"{where}: {step.kind} step {step.name!r}: no column {missing[0]!r} (columns: "
                f"{', '.join(table.schema.names)})"
            )
        duplicate = _duplicate(step.expressions()[1]) if step.kind == "select" else None
        if duplicate is not None:
            raise ConfigError(
                f"{where}: select step {step.name!r} names column {duplicate!r} twice"
            )
        try:
            table, _ = run_columns((step,), table)
        except ColumnStepFailed as e:
            error = str(e.__cause__).splitlines()[0]
            unknown = re.search(r"No match for FieldRef\.Name\((.*?)\)", error)
            if unknown:
                error = f"no column {unknown.group(1)!r}"
            raise ConfigError(
                f"{where}: {step.kind} step {step.name!r} does not evaluate on columns "
                f"({_described(table.schema)}): {error}"
            ) from None
        except _NotBoolean as e:
            raise ConfigError(
                f"{where}: where step {step.name!r} must give a boolean, not {e.type}: "
                f"{step.condition}"
            ) from None
    return table.schema


def columns_read(steps: Sequence[ColumnStep], schema: pa.Schema) -> tuple[str, ...]:
    """The columns of ``schema`` that ``steps`` (which run on it) read: without any other,
    they give the same output schema. Found as :func:`output_schema` checks a step, on
    empty tables, leaving out one column at a time; so stage 1 decodes only these."""
    if not steps:
        return tuple(schema.names)
    out = output_schema(steps, schema, "")
    kept = list(schema)
    for field in schema:
        fewer = pa.schema([f for f in kept if f.name != field.name])
        try:
            same = output_schema(steps, fewer, "").equals(out)
        except ConfigError:  # a step reads that column
            same = False
        if same and len(fewer):  # (a table of no column has no rows: keep one)
            kept = list(fewer)
    return tuple(f.name for f in kept)


class _NotBoolean(Exception):
    def __init__(self, type_: pa.DataType) -> None:
        super().__init__(str(type_))
        self.type = type_


def run_columns(
    steps: Sequence[ColumnStep], table: pa.Table, rows: np.ndarray | None = None
) -> tuple[pa.Table, np.ndarray | None]:
    """``table`` after ``steps``, and ``rows`` (a value per row of ``table``, e.g. its
    source row) kept alongside where rows are dropped; raises :class:`ColumnStepFailed`."""
    for step in steps:
        exprs, names = step.expressions()
        try:
            projected = _project(table, exprs, names)
        except (pa.ArrowException, ValueError, TypeError) as e:
            raise ColumnStepFailed(step.name, str(e)) from e
        if step.kind == "select":
            table = projected
            continue
        mask = projected.column(0)
        if not pa.types.is_boolean(mask.type):
            raise _NotBoolean(mask.type)
        keep = mask.combine_chunks().fill_null(False)
        table = table.filter(keep)
        if rows is not None:
            rows = rows[keep.to_numpy(zero_copy_only=False)]
    return table, rows


def _duplicate(names: list[str]) -> str | None:
    seen: set[str] = set()
    for n in names:
        if n in seen:
            return n
        seen.add(n)
    return None


def _described(schema: pa.Schema) -> str:
    return ", ".join(f"{f.name}: {f.type}" for f in schema)
