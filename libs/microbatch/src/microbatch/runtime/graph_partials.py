"""A dataflow graph's windows fed by sources, reduced in stage 1: partials, not records.

Stage 1 routes a run of records (:mod:`.routed_runs`) to each keyed step as one exchange
row per record, its whole payload; a window step then decodes every payload and builds
columns to aggregate a field or two. For a window step that only sources feed (a branch
of a source, as the payments job's spend per card) whose aggregates merge column-wise
(count, sum, min, max, mean, first, last — not ``collect``, custom aggregates or
sessions), stage 1 reduces the run instead — or the batch of a declared schema's columns
it keys column by column (:mod:`.column_records`) — with the window operator's own group-by
(:meth:`~microbatch.windows.operator.WindowOperator.pre_aggregate`): a partial per (key,
window) — per pane for hopping windows — and one ``partial`` row per instance whose
payload is an Arrow IPC stream of that instance's partials. Stage 2 merges them with any
records of the step that came record by record (:func:`~.windowed.run_windows`).

A run whose reduction could differ from stage 2's is not reduced (the caller routes it
record by record): a floating-point sum (its value depends on the order of its terms), a
field whose values do not make one Arrow column, a record late for every window it falls
in (stage 2 dead-letters it with its coordinates). The ``stat`` rows count the reduced
records as the records they were (:func:`counted_rows`), so the watermark, the batch's
counts and its offset sums are what they would be without the reduction.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from microbatch.runtime import windowed
from microbatch.runtime.envelope import ENVELOPE_SCHEMA, PARTIAL, RECORD
from microbatch.runtime.graph import edges_into, step_order
from microbatch.runtime.pipeline import Pipeline
from microbatch.windows.aggregate import KEY, ORDER, TS, mergeable
from microbatch.windows.operator import WindowOperator
from microbatch.windows.spec import Session

_KG = "__kg"  # carried through the group-by: where each partial's key lives


def reducing_windows(pipeline: Pipeline) -> dict[str, WindowOperator]:
    """The window steps of a dataflow graph whose records stage 1 reduces, by uid: fed
    by sources only, aggregates that merge column-wise, not sessions; none when
    ``windowed.PRE_AGGREGATE`` is off (read when called: the driver decides)."""
    if not pipeline.edges or not windowed.PRE_AGGREGATE:
        return {}
    functions = (pipeline.process, *(s.process for s in pipeline.steps))
    reducing = {}
    for uid, fn in zip(step_order(pipeline), functions, strict=True):
        operator = getattr(fn, "operator", None)
        if not getattr(fn, "columnar", False) or not isinstance(operator, WindowOperator):
            continue
        if isinstance(operator.spec, Session) or not mergeable(operator.aggregates):
            continue
        if all(isinstance(e.origin, int) for e in edges_into(pipeline, uid)):
            reducing[uid] = operator
    return reducing


@dataclasses.dataclass(frozen=True)
class Reduction:
    """How stage 1 reduces the records it routes to one window step: the step's
    ``operator``, the batch's starting ``watermark`` (stage 2 decides lateness by it) and
    the instance of each key-group. A run of records becomes the ``partial`` rows (envelope
    tuples, topic ``marked``) of its partials — record ``j`` with key bytes
    ``key_bytes[j]`` in key-group ``groups[j]``, read at ``parts[j]``/``offs[j]`` — or
    None when the run must go record by record."""

    operator: WindowOperator
    watermark: int | None
    instance_of: Sequence[int]

    def of_records(
        self, marked: str, records: Sequence[dict[str, Any]], key_bytes: Sequence[bytes],
        groups: Sequence[int], event_ts: Sequence[int], parts: Sequence[int],
        offs: Sequence[int],
    ) -> list[tuple[Any, ...]] | None:  # fmt: skip
        """A run of decoded records (:mod:`.routed_runs`)."""
        try:
            fields = {n: pa.array([r.get(n) for r in records]) for n in self.operator.fields_read()}
        except (pa.ArrowException, TypeError, ValueError, OverflowError):
            return None
        keys = pa.array(key_bytes, pa.binary())
        return self.of_columns(marked, fields, keys, groups, event_ts, parts, offs)

    def of_columns(
        self, marked: str, fields: Mapping[str, pa.Array], key_bytes: pa.Array,
        groups: Sequence[int] | np.ndarray, event_ts: Sequence[int] | np.ndarray,
        parts: Sequence[int] | np.ndarray, offs: Sequence[int] | np.ndarray,
    ) -> list[tuple[Any, ...]] | None:  # fmt: skip
        """A run as columns: ``fields`` holds (at least) the fields the aggregates read,
        row for row (:mod:`.column_records`, a source's decoded and keyed columns)."""
        operator = self.operator
        for column, fn in (n for a in operator.aggregates for n in a.needs()):
            if fn == "sum" and column in fields and pa.types.is_floating(fields[column].type):
                return None
        table = pa.table(
            {KEY: key_bytes, TS: pa.array(event_ts, pa.int64()),
             ORDER: windowed.source_orders(parts, offs),
             _KG: pa.array(groups, pa.int32()),
             **{n: fields.get(n, pa.nulls(len(key_bytes))) for n in operator.fields_read()}}
        )  # fmt: skip
        partial, late = operator.pre_aggregate(table, self.watermark, [(_KG, "min")])
        if late:
            return None
        if partial is None:
            return []
        kgs = partial.column(f"{_KG}_min").to_numpy(zero_copy_only=False)
        instances = np.asarray(self.instance_of, np.int32)[kgs]
        partial = partial.drop_columns([f"{_KG}_min"])
        first = (marked, int(parts[0]), int(offs[0]), 0)
        return [
            (PARTIAL, *first, instance, None, None, None,
             _ipc_bytes(partial.filter(pa.array(instances == instance))))
            for instance in np.unique(instances).tolist()
        ]  # fmt: skip


def counted_rows(
    marked: str,
    parts: Sequence[int] | np.ndarray,
    offs: Sequence[int] | np.ndarray,
    event_ts: Sequence[int] | np.ndarray,
) -> pa.RecordBatch:
    """``record`` rows standing for reduced records in the ``stat`` rows only: what is
    counted of a record (its partition, offset and event time), the rest null."""
    n = len(parts)
    columns = {f.name: pa.nulls(n, f.type) for f in ENVELOPE_SCHEMA}
    columns |= {
        "kind": pa.array([RECORD] * n, pa.string()),
        "topic": pa.array([marked] * n, pa.string()),
        "partition": pa.array(parts, pa.int32()),
        "offset": pa.array(offs, pa.int64()),
        "event_ts": pa.array(event_ts, pa.int64()),
    }
    return pa.RecordBatch.from_pydict(columns, schema=ENVELOPE_SCHEMA)


def reduced_partials(table: pa.Table) -> pa.Table | None:
    """The partials in ``table``'s ``partial`` rows that carry them as a payload (a
    graph's reduced windows), as one table (its :data:`KEY`: key bytes); None without."""
    rows = table.filter(
        pc.and_(pc.equal(table.column("kind"), PARTIAL), pc.is_valid(table.column("payload")))
    )
    if not rows.num_rows:
        return None
    tables = [pa.ipc.open_stream(blob).read_all() for blob in rows.column("payload").to_pylist()]
    return pa.concat_tables(tables, promote_options="permissive")


def _ipc_bytes(table: pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    blob: bytes = sink.getvalue().to_pybytes()
    return blob
