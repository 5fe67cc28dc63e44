"""Which of a pipeline's records travel as columns, and whether its column steps can run.

A source with a declared ``value_schema`` is decoded into Arrow columns in stage 1. What
happens next depends on the dataflow's shape: a chain of one source hands its columns
(after ``where``/``select``) on as envelope columns (:func:`columnar_values`); a dataflow
of several sources, or a graph, runs each source's column steps and then builds records
(:func:`record_column_steps`); a dataflow without keyed steps hands each sink its own
columns (:func:`tap_values`). The checks here run when a pipeline is built, so a key, an
event time or a column step that cannot work is refused naming the step and the field.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

import pyarrow as pa

from microbatch.errors import ConfigError
from microbatch.runtime.columns import ColumnStep, columns_read, output_schema
from microbatch.runtime.graph import edges_from
from microbatch.runtime.schema import ValueSchema, kind_of
from microbatch.runtime.steps import sink_only

if TYPE_CHECKING:
    from microbatch.runtime.pipeline import Pipeline

_KEY_TYPES = ("string", "long", "int")
_EVENT_TIME_TYPES = ("long", "int", "double", "string")


def check_value_schema(pipeline: Pipeline) -> None:
    """With a declared schema, ``key_by`` and the event-time field must be fields of it,
    of types a key and an event time can have."""
    schema = pipeline.source.value_schema
    if schema is None or pipeline.prefix or pipeline.inputs or pipeline.edges:  # reshaped
        return
    if sink_only(pipeline):  # no key, no event time read
        return
    where = f"pipeline {pipeline.name!r}"
    fields = {f.name: f for f in column_values(pipeline)}
    declared = "declared: " + ", ".join(fields)
    if pipeline.column_steps:  # the columns the key and event time are read from
        declared = "columns after the column steps: " + ", ".join(fields)
    kinds = {n: kind_of(f) for n, f in fields.items()}
    if not isinstance(pipeline.key_by, str):
        raise ConfigError(
            f"{where}: with a value_schema, key_by must name a field of it ({declared}), "
            f"not a function: {pipeline.key_by!r}"
        )
    if pipeline.key_by not in fields:
        raise ConfigError(
            f"{where}: key_by {pipeline.key_by!r} is not a field of the value_schema ({declared})"
        )
    if kinds[pipeline.key_by] not in _KEY_TYPES:
        raise ConfigError(
            f"{where}: key_by field {pipeline.key_by!r} is {kinds[pipeline.key_by]}; keys "
            f"must be one of {', '.join(_KEY_TYPES)}"
        )
    if pipeline.event_time is not None:
        field = pipeline.event_time.field
        if field not in fields:
            raise ConfigError(
                f"{where}: event_time field {field!r} is not a field of the value_schema "
                f"({declared})"
            )
        if kinds[field] not in _EVENT_TIME_TYPES:
            raise ConfigError(
                f"{where}: event_time field {field!r} is {kinds[field]}; it must be one of "
                f"{', '.join(_EVENT_TIME_TYPES)} (epoch ms, or ISO-8601 strings)"
            )


def check_column_steps(pipeline: Pipeline) -> None:
    """Column steps need what they run on — one source's declared columns, before any
    record exists — and must evaluate on them; their output schema is kept (the columns
    stage 1 hands on: :func:`columnar_values`)."""
    where = f"pipeline {pipeline.name!r}"
    taps = [t for t in pipeline.source_taps if t.columns]
    if taps and not sink_only(pipeline):
        raise ConfigError(
            f"{where}: sink {taps[0].sink!r} after column steps: in a dataflow with keyed "
            "steps not supported yet (a dataflow of sources and sinks only is)"
        )
    if pipeline.inputs or pipeline.edges or (pipeline.column_steps and pipeline.prefix):
        check_record_column_steps(pipeline, where)
        return
    if not pipeline.column_steps:
        return
    step = pipeline.column_steps[0]
    schema = pipeline.source.value_schema
    if schema is None:
        raise ConfigError(
            f"{where}: {step.kind} step {step.name!r} runs on the columns of a declared "
            "schema: give the source value_schema=JsonSchema(...)"
        )
    if pipeline.enrich is not None:
        raise ConfigError(
            f"{where}: {step.kind} step {step.name!r}: column steps run right after the "
            "source, in a dataflow without enrichment"
        )
    if pipeline.source_taps:
        raise ConfigError(
            f"{where}: {step.kind} step {step.name!r}: sinks fed by the source (before the "
            "first keyed step) beside column steps are not supported yet in a dataflow with "
            "keyed steps; feed the sink from a keyed step"
        )
    values = output_schema(pipeline.column_steps, schema.arrow_schema, where)
    object.__setattr__(pipeline, "_column_values", values)
    _read(pipeline, 0, columns_read(pipeline.column_steps, schema.arrow_schema))


def record_column_steps(pipeline: Pipeline) -> dict[int, tuple[ColumnStep, ...]]:
    """Per source index: the column steps stage 1 runs on that source's columns before
    it builds the source's records, in a dataflow whose records travel as payloads
    (several sources, a graph, or record-wise steps after the column steps); empty for a
    chain of one source without record-wise steps (its records travel as columns) and
    for sources without column steps."""
    if pipeline.inputs:
        return {i: inp.columns for i, inp in enumerate(pipeline.inputs) if inp.columns}
    if (pipeline.edges or pipeline.prefix) and pipeline.column_steps:
        return {0: tuple(pipeline.column_steps)}
    return {}


def decoded_as_columns(pipeline: Pipeline) -> dict[int, tuple[ColumnStep, ...]]:
    """Per source index whose rows stage 1 decodes as columns before it builds records:
    its column steps (:func:`record_column_steps`), and, in a dataflow of several sources
    or a graph without enrichment, none for a declared schema's source without any. Its
    values then cost one ``pyarrow.json`` parse per batch and its keys one per distinct
    key, not a ``json.loads`` and a keying per record; its records are the same."""
    steps = record_column_steps(pipeline)
    if pipeline.enrich is not None or not (pipeline.inputs or pipeline.edges):
        return steps
    sources = [i.source for i in pipeline.inputs] if pipeline.inputs else [pipeline.source]
    return {
        i: steps.get(i, ())
        for i, source in enumerate(sources)
        if i in steps or source.value_schema is not None
    }


def check_record_column_steps(pipeline: Pipeline, where: str) -> None:
    """Column steps of several sources, of a graph's source, or before record-wise
    steps: each on its source's declared columns, no source sink of that source beside
    them, and every field a ``key_by`` (by name) of its edges or the event time reads
    kept, where no record-wise step comes between."""
    if pipeline.inputs and pipeline.column_steps:
        step = pipeline.column_steps[0]
        raise ConfigError(
            f"{where}: {step.kind} step {step.name!r}: with several sources, each source's "
            "column steps are its own (Input.columns)"
        )
    for index, steps in record_column_steps(pipeline).items():
        source = pipeline.inputs[index].source if pipeline.inputs else pipeline.source
        step = steps[0]
        named = f"{where}: {step.kind} step {step.name!r} (source of {list(source.topics)})"
        if source.value_schema is None:
            raise ConfigError(
                f"{named} runs on the columns of a declared schema: give the source "
                "value_schema=JsonSchema(...)"
            )
        if pipeline.enrich is not None:
            raise ConfigError(f"{named}: column steps do not run with enrichment")
        edges = edges_from(pipeline, index)
        taps = [t for t in pipeline.source_taps if t.source in (None, index)]
        if taps:
            raise ConfigError(
                f"{named}: sink {taps[0].sink!r} fed by the same source beside column steps "
                "is not supported yet; feed the sink from a keyed step"
            )
        values = output_schema(steps, source.value_schema.arrow_schema, where)
        _read(pipeline, index, columns_read(steps, source.value_schema.arrow_schema))
        # What the keys and the event time read, unless a record-wise step after the
        # column steps makes the records they read (it may add a field a select dropped).
        reshaped = bool(pipeline.prefix) or any(e.chain for e in edges)
        if pipeline.inputs:
            reshaped = bool(pipeline.inputs[index].prefix) or reshaped
        needed = [(e.key_by, f"key_by of step {e.target!r}") for e in edges
                  if isinstance(e.key_by, str) and not e.chain and not pipeline.prefix]  # fmt: skip
        if pipeline.event_time is not None and not reshaped:
            needed.append((pipeline.event_time.field, "the event time (EventTime field)"))
        for field, reader in needed:
            if field in values.names:
                continue
            dropping = _dropping(steps, field)
            if dropping is None:  # never there: the per-record path would dead-letter all
                raise ConfigError(
                    f"{named}: {reader} reads column {field!r}, which the source's "
                    f"value_schema does not declare (columns after the column steps: "
                    f"{', '.join(values.names)})"
                )
            raise ConfigError(
                f"{where}: select step {dropping.name!r} of the source of "
                f"{list(source.topics)} drops column {field!r}, which {reader} reads "
                f"(columns after it: {', '.join(values.names)}); keep it in the select"
            )


def _dropping(steps: Sequence[ColumnStep], field: str) -> ColumnStep | None:
    """The last ``select`` of ``steps`` whose output has no column ``field``."""
    return next(
        (s for s in reversed(steps) if s.kind == "select" and field not in s.expressions()[1]),
        None,
    )


def check_sink_only(pipeline: Pipeline, where: str) -> None:
    """A dataflow without keyed steps: its sinks take the source's records, through
    record-wise steps, or column-wise ones (then as columns: :func:`tap_values`)."""
    if pipeline.steps or pipeline.edges or pipeline.taps or pipeline.column_steps:
        raise ConfigError(f"{where}: a pipeline without keyed steps has sinks fed by sources only")
    if not pipeline.source_taps:
        raise ConfigError(f"{where}: no keyed step and no sink: send the source to a sink")
    if pipeline.inputs:
        raise ConfigError(
            f"{where}: a dataflow without keyed steps reads one source (several: not yet)"
        )
    columns = [t for t in pipeline.source_taps if t.columns]
    record_wise = [t for t in pipeline.source_taps if t.chain]
    both = [t for t in columns if t.chain]
    if both:
        raise ConfigError(
            f"{where}: sink {both[0].sink!r}: map/filter/flat_map after where/select in a "
            "dataflow without keyed steps is not supported yet; use one kind of step"
        )
    if columns and record_wise:
        raise ConfigError(
            f"{where}: sink {columns[0].sink!r} takes columns (where/select) and sink "
            f"{record_wise[0].sink!r} records (map/filter/flat_map); in one dataflow without "
            "keyed steps, use one kind"
        )
    schema = pipeline.source.value_schema
    if columns and (schema is None or pipeline.enrich is not None):
        raise ConfigError(
            f"{where}: sink {columns[0].sink!r}: column steps need the source's declared "
            "schema (value_schema=), and no enrichment"
        )
    if schema is None or record_wise or pipeline.enrich is not None:
        return  # the records travel as payloads
    values: dict[str, pa.Schema] = {}
    types: dict[str, tuple[str, pa.DataType]] = {}
    read: set[str] = set()
    for tap in pipeline.source_taps:
        out = output_schema(tap.columns, schema.arrow_schema, where)
        read.update(columns_read(tap.columns, schema.arrow_schema))
        for f in out:
            before = types.setdefault(f.name, (tap.sink, f.type))
            if before[1] != f.type:
                raise ConfigError(
                    f"{where}: sinks {before[0]!r} and {tap.sink!r} take column {f.name!r} "
                    f"as {before[1]} and {f.type}; rename one with select()"
                )
        values[tap.sink] = out
    object.__setattr__(pipeline, "_tap_values", values)
    _read(pipeline, 0, tuple(n for n in schema.arrow_schema.names if n in read))


def _read(pipeline: Pipeline, index: int, names: tuple[str, ...]) -> None:
    object.__setattr__(pipeline, "_columns_read", {**columns_read_by(pipeline), index: names})


def columns_read_by(pipeline: Pipeline) -> dict[int, tuple[str, ...]]:
    """Per source index with column steps: the declared fields they read, the only ones
    stage 1 builds columns of (it still checks every field: the dead letters are the
    same). A source not named here needs them all (its records hold every field)."""
    return cast("dict[int, tuple[str, ...]]", pipeline.__dict__.get("_columns_read", {}))


def tap_values(pipeline: Pipeline) -> dict[str, pa.Schema] | None:
    """Per sink of a dataflow without keyed steps whose records travel as columns: the
    columns it takes; None when they travel as payloads."""
    return cast("dict[str, pa.Schema] | None", pipeline.__dict__.get("_tap_values"))


def columnar_values(pipeline: Pipeline) -> Any:
    """The Arrow schema of the record columns stage 1 hands stage 2 (after the column
    steps), or None when records travel as payloads (no declared schema, or enrichment
    or stateless steps, which work on records)."""
    schema = pipeline.source.value_schema
    if sink_only(pipeline):  # every sink's columns, in one envelope
        taps = tap_values(pipeline)
        if taps is None:
            return None
        fields = {f.name: f for out in taps.values() for f in out}
        return pa.schema(list(fields.values()))
    if (
        schema is None
        or pipeline.enrich is not None
        or pipeline.prefix
        or pipeline.inputs
        or pipeline.source_taps
        or pipeline.edges
    ):
        return None
    return column_values(pipeline)


def column_values(pipeline: Pipeline) -> pa.Schema:
    """The declared schema's columns after the pipeline's column steps (its source has a
    ``value_schema``)."""
    if pipeline.column_steps:
        return cast(pa.Schema, pipeline.__dict__["_column_values"])
    return cast(ValueSchema, pipeline.source.value_schema).arrow_schema
