"""The sink protocol: what the batch runtime asks of an output, and nothing else.

A sink's life in a batch has two halves, split by the checkpoint's commit:

1. **stage** (inside each stage-2 task, before the commit): turn the instance's rows into
   bytes at keys made of the batch, the instance and the attempt (``ctx.attempt``) — the
   same rows give the same bytes, and no attempt overwrites another's files — and say
   what was written (a :class:`Staged`);
2. **publish** (on the driver, after the commit): make exactly the staged output the
   committed manifest names visible, idempotently — a rerun after a crash may publish
   again, and a reader must still see each row once.

A sink also says whether its output can be taken back (:attr:`Sink.retractable`: a rewind
or backfill replaces the undone batches' output, or refuses) and whether its staged files
must live where every executor reaches them (:meth:`Sink.shared_storage_url`). The runtime
never asks which kind a sink is; a new sink is one class in one file of this package
(see docs/runtime.md, "Writing a sink").
"""

from __future__ import annotations

import abc
import dataclasses
import itertools
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import pyarrow as pa

from microbatch.checkpoint.layout import Layout
from microbatch.datasets import DatasetRef
from microbatch.settings import Settings
from microbatch.storage import ObjectStore


@dataclasses.dataclass(frozen=True)
class Staged:
    """What one instance staged for one sink in one batch: an object and its row count."""

    file: str
    rows: int

    def to_json(self) -> dict[str, Any]:
        return {"file": self.file, "rows": self.rows}

    @classmethod
    def from_json(cls, body: Mapping[str, Any]) -> Staged:
        return cls(str(body["file"]), int(body["rows"]))


@dataclasses.dataclass(frozen=True)
class StageContext:
    """Where and for whom a stage-2 instance stages its output."""

    pipeline: str
    batch_id: int
    instance: int
    settings: Settings
    #: The pipeline's checkpoint store (sinks that stage next to the checkpoint use it).
    checkpoint_store: ObjectStore
    layout: Layout
    #: Unique per attempt of the batch: part of every staged name, so an attempt never
    #: overwrites what another (a retry, a zombie) staged or published.
    attempt: str = ""


@dataclasses.dataclass(frozen=True)
class PublishContext:
    """A committed batch, as publishing needs it (everything comes from the manifest)."""

    pipeline: str
    batch_id: int
    settings: Settings
    checkpoint_store: ObjectStore
    layout: Layout
    #: This sink's staged output, one entry per instance that wrote any.
    staged: tuple[Staged, ...]
    #: ``"topic:partition"`` → the offset after the batch's input.
    end_offsets: Mapping[str, int]
    #: Undone batches (of a rewind) whose output this batch replaces.
    supersedes: tuple[int, ...] = ()


#: Undone batches whose output is still visible → their end offsets (None: unknown, never
#: replaced). Keys are batch ids as strings: the mapping lives in checkpoint JSON.
Awaiting = dict[str, "dict[str, int] | None"]


class Sink(abc.ABC):
    """One output of a pipeline. Implementations are frozen dataclasses (they travel to
    Spark tasks pickled) with a ``name`` unique in the pipeline."""

    name: str
    #: Can the output of a batch be replaced after publishing (by a rewind or backfill)?
    retractable: ClassVar[bool] = False

    @abc.abstractmethod
    def stage(self, ctx: StageContext, rows: Sequence[Any]) -> Staged | None:
        """Stage one instance's ``rows`` (plain records); None when nothing was written."""

    def stage_columns(self, ctx: StageContext, table: pa.Table) -> Staged | None:
        """Stage one instance's records given as columns (a dataflow whose records never
        became Python objects: :mod:`microbatch.runtime.column_taps`). Sinks that write
        Arrow tables take them as they are; the others, as records."""
        return self.stage(ctx, table.to_pylist())

    @abc.abstractmethod
    def publish(self, ctx: PublishContext) -> None:
        """Make the committed batch's staged output visible, exactly once."""

    def publish_rewind(self, ctx: PublishContext, undone: Sequence[int]) -> None:  # noqa: B027
        """A rewind committed as ``ctx.batch_id`` undoes ``undone``: record it, so later
        batches can replace their output. Nothing to do for output that cannot be
        replaced (the runtime refuses such rewinds unless told to accept repeats)."""

    def awaiting_replacement(self, settings: Settings, undone: Sequence[int]) -> Awaiting:
        """Undone batches (also ``undone``, a rewind about to commit) whose output is
        still visible, read from the sink itself; empty for a sink that cannot retract."""
        return {}

    def collect_orphans(self, settings: Settings, batches: Sequence[int]) -> int:
        """Delete what attempts that lost the commit staged for ``batches`` (published
        long ago, leaving retention) in the sink's own storage; returns how many objects
        went. Nothing to do for a sink that stages next to the checkpoint (the runtime's
        retention collects that) or whose output is a log (Kafka)."""
        return 0

    def dataset(self, settings: Settings) -> DatasetRef | None:
        """The dataset this sink writes, named for lineage (:mod:`microbatch.datasets`);
        None for a sink whose output has no such name."""
        return None

    def shared_storage_url(self) -> str | None:
        """Where stage-2 tasks write this sink's files, if outside the checkpoint store:
        on a real cluster it must be storage every executor reaches (S3)."""
        return None

    @abc.abstractmethod
    def last_published(self, settings: Settings, pipeline: str) -> int | None:
        """The newest batch id this sink has published for ``pipeline``, None if none.

        Batch ids restart at 0 with a new checkpoint location, and a sink that remembers
        published ids would skip or overwrite the new batches: the runtime asks this before
        a pipeline's first batch and refuses to start over a sink with history."""


def rows_to_table(
    sink_name: str, records: Sequence[Any], schema: pa.Schema | None, where: str = ""
) -> pa.Table:
    """Plain records (dicts) as an Arrow table of ``schema``, or of an inferred one.

    Inferred, the columns are the union of every record's fields in first-appearance
    order (null where a record lacks one), each typed over all its values: pyarrow's own
    ``from_pylist`` takes the fields of the first record only and would drop the rest.
    Ints and floats in one field become float64 (pyarrow's promotion, which refuses an
    int a float64 cannot hold exactly); other mixed types are a :class:`SinkError` naming
    the field. ``where`` (e.g. ``"pipeline 'p' batch 3 instance 1"``) prefixes errors."""
    from microbatch.errors import SinkError

    prefix = f"{where} sink {sink_name!r}" if where else f"sink {sink_name!r}"
    if schema is not None:
        if (table := table_of_typed_dicts(records, schema)) is not None:
            return table
        try:
            return pa.Table.from_pylist(list(records), schema=schema)
        except (pa.ArrowException, TypeError, ValueError) as e:
            raise SinkError(
                f"{prefix}: records do not fit its schema ({e}); first record: {records[0]!r:.300}"
            ) from e
    try:
        return table_of_dicts(records)
    except (pa.ArrowException, TypeError, ValueError, AttributeError) as e:
        raise inference_error(prefix, records, e) from e


def conformed(sink_name: str, table: pa.Table, schema: pa.Schema | None) -> pa.Table:
    """Columns as a table of the sink's ``schema``: each column cast, a missing one null,
    an extra one left out — what the same records give through :func:`rows_to_table`.
    Without a schema, the table as it is."""
    from microbatch.errors import SinkError

    if schema is None:
        return table
    columns = []
    for field in schema:
        if field.name not in table.column_names:
            columns.append(pa.nulls(table.num_rows, field.type))
            continue
        try:
            columns.append(table.column(field.name).cast(field.type))
        except (pa.ArrowException, ValueError, TypeError) as e:
            raise SinkError(
                f"sink {sink_name!r}: column {field.name!r} "
                f"({table.schema.field(field.name).type}) does not fit the sink's schema "
                f"({field.type}): {e}"
            ) from e
    return pa.Table.from_arrays(columns, schema=schema)


def table_of_typed_dicts(records: Sequence[Any], schema: pa.Schema) -> pa.Table | None:
    """Plain dicts as a table of ``schema`` in one pass of Arrow's own converter (a struct
    array, split into columns): about twice as fast as ``from_pylist``, which gathers
    every column in Python first, and the same table — each value goes through the same
    conversion, a missing field is null, an extra one ignored. None when that sameness is
    not certain, so the caller takes ``from_pylist`` (and its errors): a record that is
    not exactly a dict (a tuple would fill a struct by position), a first record without
    any of the schema's names (Arrow would then match ``bytes`` keys too), repeated
    column names, or values Arrow refuses."""
    if not records or len(set(schema.names)) != len(schema.names):
        return None
    if set(map(type, records)) != {dict} or not any(n in records[0] for n in schema.names):
        return None
    try:
        values = pa.array(records, type=pa.struct(schema))
    except (pa.ArrowException, TypeError, ValueError, OverflowError):
        return None
    if not isinstance(values, pa.StructArray):  # chunked: too large for one array
        return None
    batch = pa.RecordBatch.from_struct_array(values)
    return pa.Table.from_batches([batch]).replace_schema_metadata(schema.metadata)


def table_of_dicts(records: Sequence[Any]) -> pa.Table:
    """Dicts as a table whose columns are the union of their fields, in first-appearance
    order (pyarrow's ``from_pylist`` alone takes the first dict's fields and drops the
    rest). Raises what pyarrow raises for values no column can hold."""
    if not records:
        return pa.table({})
    fields = set().union(*records)  # one C-level pass: cheap next to the conversion
    if len(fields) == len(records[0]):  # the common case: no field beyond the first's
        return pa.Table.from_pylist(list(records))
    # Lead with a dict that has every field (all null, so it types nothing), then drop it
    # (a zero-copy slice).
    every_field = dict.fromkeys(itertools.chain.from_iterable(records))
    return pa.Table.from_pylist([every_field, *records]).slice(1)


def inference_error(prefix: str, records: Sequence[Any], cause: Exception) -> Exception:
    """Why ``records`` have no inferred schema: a record that is not a dict, or the
    field whose values have incompatible types (both types and the records that have
    them); diagnosing rescans the records, which only a failing batch pays."""
    from microbatch.errors import SinkError

    hint = "declare the sink's schema (a pyarrow.Schema), or make the records agree"
    for i, record in enumerate(records):
        if not isinstance(record, Mapping):
            return SinkError(
                f"{prefix}: record {i} is a {type(record).__name__}, not a dict: a sink "
                f"without a schema writes dicts, one field per column ({record!r:.200})"
            )
    names = dict.fromkeys(itertools.chain.from_iterable(records))
    for name in names:
        values = [record.get(name) for record in records]
        try:
            pa.array(values)
        except (pa.ArrowException, TypeError, ValueError) as e:
            return SinkError(f"{prefix}: field {name!r} {clash(values, e)}; {hint}")
    return SinkError(f"{prefix}: no schema can be inferred for its records ({cause}); {hint}")


def clash(values: Sequence[Any], cause: Exception) -> str:
    """The first two values of ``values`` that pyarrow cannot put in one column."""
    first: int | None = None
    for i, value in enumerate(values):
        if value is None:
            continue
        try:
            pa.array([value])
        except (pa.ArrowException, TypeError, ValueError) as e:
            return f"has a value no Arrow type holds in record {i} ({value!r:.100}: {e})"
        if first is None:
            first = i
            continue
        try:
            pa.array([values[first], value])
        except (pa.ArrowException, TypeError, ValueError) as e:
            return (
                f"has incompatible types: {arrow_type(values[first])} in record {first} "
                f"({values[first]!r:.100}) and {arrow_type(value)} in record {i} "
                f"({value!r:.100}): {e}"
            )
    return f"has values of incompatible types ({cause})"


def arrow_type(value: Any) -> str:
    return str(pa.array([value]).type)


#: Column types a table may be partitioned by (identity partitions: one folder per value).
PARTITION_TYPES = (pa.types.is_string, pa.types.is_integer, pa.types.is_boolean, pa.types.is_date)


def partition_columns(sink_name: str, schema: pa.Schema, partition_by: Any) -> tuple[str, ...]:
    """``partition_by`` (a name or names) as a tuple, each a string, integer, boolean or
    date column of ``schema``; a :class:`ConfigError` naming the column otherwise."""
    from microbatch.errors import ConfigError

    columns = (partition_by,) if isinstance(partition_by, str) else tuple(partition_by)
    for col in columns:
        idx = schema.get_field_index(col)
        if idx < 0:
            raise ConfigError(
                f"sink {sink_name!r}: partition column {col!r} is not in the schema "
                f"({', '.join(schema.names)})"
            )
        if not any(is_type(schema.field(idx).type) for is_type in PARTITION_TYPES):
            raise ConfigError(
                f"sink {sink_name!r}: partition column {col!r} has type "
                f"{schema.field(idx).type}; use a string, integer, boolean or date"
            )
    return columns
