"""Where a keyed step's records go, inside one instance of stage 2.

A single-operator pipeline sends what ``process`` emits to every sink (or to the one named
by ``ctx.emit(record, to=...)``). In a dataflow each keyed step sends its main output to
its taps (each through its stateless steps) and along each edge out of it (to the keyed
steps that read it): those records are keyed and become envelope rows of the next
exchange, numbered per key-group of this step (``topic`` = ``@<uid>><target>``,
``partition`` = key-group, ``offset`` = its count), so the target sees every key's
records in one order whatever the parallelism.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from itertools import repeat
from operator import itemgetter
from typing import Any

import numpy as np
import pyarrow as pa

from microbatch.errors import ConfigError, MicrobatchError, ProcessError, error_text
from microbatch.keygroups import encode_key, key_group_of_bytes, operator_indexes
from microbatch.runtime.decoding import event_time_ms
from microbatch.runtime.envelope import (
    DEAD_LETTER,
    ENVELOPE_SCHEMA,
    RECORD,
    DeadLetterDetail,
    EnvelopeBuilder,
    encode_payload,
)
from microbatch.runtime.graph import Edge, edges_from, first_uid, marker
from microbatch.runtime.handon import (
    ColumnsHandedOn,
    HandedOn,
    Placed,
    hand_on,
    hand_on_columns,
    key_placements,
)
from microbatch.runtime.pipeline import Pipeline
from microbatch.runtime.steps import Chain, KeyedStep, StepFailed, Tap, run_chain

DeadLetter = Callable[..., None]
_KEYS_REMEMBERED = 100_000  # keys of the next step whose placement is kept
#: A call that emits fewer records goes record by record (a run's set-up costs ~2 µs).
_AT_ONCE_FROM = 4


def step_index(pipeline: Pipeline, uid: str | None) -> int:
    """0 for the first keyed step (``uid`` None), else 1 + the step's place in ``steps``."""
    if uid is None:
        return 0
    for i, step in enumerate(pipeline.steps):
        if step.uid == uid:
            return i + 1
    raise ConfigError(f"pipeline {pipeline.name!r} has no keyed step {uid!r}")


def next_step(pipeline: Pipeline, uid: str | None) -> KeyedStep | None:
    i = step_index(pipeline, uid)
    return pipeline.steps[i] if i < len(pipeline.steps) else None


def own_sinks(pipeline: Pipeline, uid: str | None) -> tuple[str, ...]:
    """The sinks step ``uid`` stages (None: the first step): every sink of a
    single-operator pipeline, else the step's taps."""
    if pipeline.taps is None:
        return tuple(s.name for s in pipeline.sinks)
    staged = step_taps(pipeline, uid)
    if uid is None:  # and the sinks fed before it, whose records it stages
        staged = (*pipeline.source_taps, *staged)
    return tuple(t.sink for t in staged)


def step_taps(pipeline: Pipeline, uid: str | None) -> tuple[Tap, ...]:
    """Where step ``uid``'s output goes (None: the first step); empty for a
    single-operator pipeline, whose output goes to every sink."""
    if uid is None:
        return tuple(pipeline.taps or ())
    return tuple(pipeline.steps[step_index(pipeline, uid) - 1].taps)


class Router:
    """Collects one instance's output of step ``uid``: rows per own sink, and envelope
    rows for the next keyed step (``forward``)."""

    def __init__(
        self,
        where: str,
        pipeline: Pipeline,
        uid: str | None,
        parallelism: int,
        dead_letter: DeadLetter,
    ) -> None:
        self.where = where
        self.pipeline = pipeline
        self.uid = uid
        self.parallelism = parallelism
        self.dead_letter = dead_letter
        self.outputs: dict[str, list[Any]] = {n: [] for n in own_sinks(pipeline, uid)}
        #: Main output kept as columns per sink (:meth:`emit_table`), before ``outputs``.
        self.tables: dict[str, list[pa.Table]] = {}
        self.single = pipeline.taps is None
        self.main_taps = [t for t in step_taps(pipeline, uid) if not t.side]
        own = uid if uid is not None else first_uid(pipeline)
        functions = {s.uid: s.process for s in pipeline.steps}
        et = pipeline.event_time
        time_field = None if et is None else et.field
        #: Where the main output goes on: one way per edge out of this step.
        self.ways = [
            _Way(e, marker(own, e.target), _windowed(functions[e.target]), time_field)
            for e in edges_from(pipeline, own)
        ]
        self.forward = EnvelopeBuilder()
        self._count = [0] * pipeline.max_parallelism  # rows handed on per key-group
        self._rows = _Rows()
        self._keys: dict[Any, Placed] = {}
        self._instance_of = operator_indexes(pipeline.max_parallelism, parallelism)
        #: The one way a call's records go on all at once (:mod:`.handon`): along a single
        #: edge without steps, keyed by a field, besides taps without steps of their own
        #: (a tap's function could change a record before the edge encodes it).
        plain_taps = all(not t.chain for t in self.main_taps)
        self._main_sinks = {t.sink for t in self.main_taps}
        self._at_once = (
            self.ways[0]
            if len(self.ways) == 1
            and not self.ways[0].edge.chain
            and self.ways[0].key_field is not None
            and plain_taps
            else None
        )

    def emit(self, emitted: Sequence[tuple[str | None, Any]], key_group: int) -> None:
        """What one ``process``/``on_timer`` call emitted (``ctx.emitted``)."""
        if self._at_once is not None and len(emitted) >= _AT_ONCE_FROM:
            self._emit_at_once(emitted, key_group, self._at_once)
        else:
            self._emit_each(emitted, key_group)

    def _emit_each(self, emitted: Sequence[tuple[str | None, Any]], key_group: int) -> None:
        for sink, record in emitted:
            if sink is None:
                self.main(record, key_group)
            elif sink in self.outputs:
                self.outputs[sink].append(record)
            else:
                raise ConfigError(
                    f"{self.where}: ctx.emit(..., to={sink!r}) names no sink of this step "
                    f"(its sinks: {sorted(self.outputs)})"
                )

    def _emit_at_once(
        self, emitted: Sequence[tuple[str | None, Any]], key_group: int, way: _Way
    ) -> None:
        """:meth:`emit` with the main output handed on as one run (:func:`hand_on`);
        record by record when a record may be a dead letter. Rows, offsets and dead
        letters come out as record by record."""
        main = [record for sink, record in emitted if sink is None]
        if len(main) != len(emitted):  # side outputs, in their own sinks' order
            side = [(sink, r) for sink, r in emitted if sink is not None]
            if any(sink in self._main_sinks for sink, _ in side):
                self._emit_each(emitted, key_group)  # one sink gets both: keep the order
                return
            self._emit_each(side, key_group)
        if not main:
            return
        assert way.key_field is not None
        run = hand_on(
            main, way.key_field, way.time_field, way.windowed, self._keys, self._place,
            _KEYS_REMEMBERED,
        )  # fmt: skip
        if run is None:
            for record in main:
                self.main(record, key_group)
            return
        for tap in self.main_taps:  # none with steps of its own
            self.outputs[tap.sink].extend(main)
        start = self._count[key_group]
        self._count[key_group] = start + len(main)
        self._rows.extend(way.marker, key_group, start, run)

    def emit_keyed_rows(self, rows: Sequence[Any]) -> None:
        """A window's output rows, each under its ``key``'s key-group (in runs per
        key-group, in the order of their first rows)."""
        maxp = self.pipeline.max_parallelism
        kg_of: dict[Any, int] = {}
        by_group: dict[int, list[Any]] = {}
        for row in rows:
            key = row.get("key") if isinstance(row, dict) else None
            cached = type(key) is int or type(key) is str
            kg = kg_of.get(key) if cached else None
            if kg is None:
                kg = 0 if key is None else key_group_of_bytes(encode_key(key), maxp)
                if cached:
                    kg_of[key] = kg
            if self.single:
                self.main(row, kg)
            else:
                by_group.setdefault(kg, []).append((None, row))
        for kg, run in by_group.items():
            self.emit(run, kg)

    def emit_columns(self, table: pa.Table) -> bool:
        """A window's output rows (``key``, ``window_start``, ``window_end``, results),
        in the order it emits them, handed on column by column — the same envelope rows
        as :meth:`emit_keyed_rows` of ``table.to_pylist()``, without a dict per row.
        False when they cannot be (several ways on, steps in between, a row that may be
        a dead letter): nothing is handed on, the caller emits them row by row."""
        way = self._at_once
        if self.single or way is None or way.key_field is None:
            return False
        maxp = self.pipeline.max_parallelism
        own = key_placements(table.column("key"), maxp)
        if own is None:
            return False
        run = hand_on_columns(table, way.key_field, way.time_field, maxp)
        if run is None:
            return False
        groups = own[1]
        if self.main_taps:  # none with steps of its own; rows in key-group runs
            rows = table.take(_in_group_runs(groups)).to_pylist()
            for tap in self.main_taps:
                self.outputs[tap.sink].extend(rows)
        offsets = _numbered(groups, self._count)
        instances = np.asarray(self._instance_of, dtype=np.int32)[run.key_group]
        self._rows.add_columns(way.marker, groups, offsets, run, instances)
        return True

    def emit_table(self, table: pa.Table, key_groups: np.ndarray) -> None:
        """Main output given as columns (row ``i`` under key-group ``key_groups[i]``, in
        key order): kept as a table where it goes only to sinks, straight from the step;
        else record by record, as :meth:`emit` of each key-group's run."""
        if not self.single and not self.ways and all(not t.chain for t in self.main_taps):
            table = as_records_give(table)
            for tap in self.main_taps:
                self.tables.setdefault(tap.sink, []).append(table)
            return
        rows = table.to_pylist()
        starts = [0, *(np.flatnonzero(np.diff(key_groups)) + 1).tolist()]
        for start, end in zip(starts, [*starts[1:], len(rows)], strict=True):
            self.emit([(None, row) for row in rows[start:end]], int(key_groups[start]))

    def main(self, record: Any, key_group: int) -> None:
        """One record of the step's main output."""
        if self.single:
            for rows in self.outputs.values():
                rows.append(record)
            return
        for tap in self.main_taps:
            self.outputs[tap.sink].extend(self._chain(tap.chain, record))
        for way in self.ways:
            for r in self._chain(way.edge.chain, record):
                self._forward(r, key_group, way)

    def _chain(self, chain: Chain, record: Any) -> list[Any]:
        if not chain:
            return [record]
        try:
            return run_chain(chain, record)
        except StepFailed as e:
            if self.pipeline.on_process_error == "fail":
                raise ProcessError(
                    f"{self.where}: {e}. Fix the function, or set on_process_error='dead_letter'."
                ) from e
            self.dead_letter("step_failed", str(e), raw_value=_json(record))
            return []

    def _forward(self, record: Any, key_group: int, way: _Way) -> None:
        edge = way.edge
        field = way.key_field
        if field is not None and type(record) is dict:  # what key_of does, minus a call
            key = record.get(field)
        else:
            try:
                key = edge.key_of(record)
            except Exception as e:  # user code
                self.dead_letter("bad_key", f"step {edge.target!r}: key_by raised "
                                 f"{error_text(e)}", raw_value=_json(record))  # fmt: skip
                return
        if key is None:
            self.dead_letter("missing_key", f"step {edge.target!r}: key_by {edge.key_by!r} "
                             "gave no key", raw_value=_json(record))  # fmt: skip
            return
        try:
            known = self._keys.get(key) if type(key) is str else None
            if known is None:
                known = self._place(encode_key(key))
                if type(key) is str and len(self._keys) < _KEYS_REMEMBERED:
                    self._keys[key] = known
            payload = encode_payload(record)
        except MicrobatchError as e:
            self.dead_letter("bad_key", f"step {edge.target!r}: {e}", raw_value=_json(record))
            return
        ts = self._event_time(record, way)
        if ts is False:
            return
        rows = self._rows
        rows.topic.append(way.marker)
        rows.partition.append(key_group)
        rows.offset.append(self._count[key_group])
        self._count[key_group] += 1
        rows.placed.append(known)
        rows.ts.append(ts)
        rows.payload.append(payload)

    def record_rows(self) -> pa.RecordBatch:
        """The records this step hands on, keyed for the steps that read it."""
        return self._rows.batch()

    def dead_letter_rows(self) -> pa.RecordBatch:
        """The dead letters so far (of this step and those before), handed on."""
        return self.forward.rows_batch()

    def _place(self, key_bytes: bytes) -> Placed:
        """(key bytes, key-group, instance) of a key of the next step."""
        kg = key_group_of_bytes(key_bytes, self.pipeline.max_parallelism)
        return key_bytes, kg, self._instance_of[kg]

    def _event_time(self, record: Any, way: _Way) -> int | bool | None:
        """The record's event time for the next step (None: it has none), or False after
        dead-lettering a record a window cannot place. A window's output row without the
        event-time field takes its window's last millisecond, as in Flink."""
        field = way.time_field
        raw = record.get(field) if field is not None and type(record) is dict else None
        if raw is None and isinstance(record, dict) and isinstance(record.get("window_end"), int):
            raw = record["window_end"] - 1
        where = f"step {way.edge.target!r}"
        if raw is None:
            if way.windowed:
                error = f"{where}: a window needs the event-time field {field!r}"
                self.dead_letter("missing_event_time", error, raw_value=_json(record))
                return False
            return None
        if type(raw) is int:
            return raw
        try:
            return event_time_ms(raw)
        except (ValueError, TypeError, OverflowError) as e:
            self.dead_letter("bad_event_time", f"{where}: {e}", raw_value=_json(record))
            return False

    def forward_dead_letters(self, dead: Sequence[dict[str, Any]], instance: int) -> None:
        """Dead letters of this step and before, handed on: the last step stages them."""
        for d in dead:
            detail = DeadLetterDetail(
                d["reason"], d["error"], d.get("raw_key"), d.get("raw_value"), d.get("attempts"),
                d.get("step"),
            )  # fmt: skip
            self.forward.add(DEAD_LETTER, d.get("topic"), d.get("partition"), d.get("offset"),
                             0, instance, None, None, None, detail.to_payload())  # fmt: skip


class _Way:
    """One edge out of the step, with what forwarding along it needs at hand."""

    __slots__ = ("edge", "key_field", "marker", "time_field", "windowed")

    def __init__(self, edge: Edge, marker: str, windowed: bool, time_field: str | None) -> None:
        self.edge = edge
        self.marker = marker
        self.windowed = windowed
        self.time_field = time_field
        self.key_field = edge.key_by if isinstance(edge.key_by, str) else None


class _Rows:
    """The next steps' record rows, column by column (the hot path of a dataflow)."""

    def __init__(self) -> None:
        self.topic: list[str] = []
        self.partition: list[int] = []
        self.offset: list[int] = []
        self.placed: list[Placed] = []  # (key bytes, key-group, instance)
        self.ts: list[int | None] = []
        self.payload: list[bytes] = []
        #: Rows added column-wise (:meth:`add_columns`), after the listed ones.
        self.batches: list[pa.RecordBatch] = []

    def extend(self, marker: str, key_group: int, start: int, run: HandedOn) -> None:
        """A run of records of one key-group, numbered from ``start``."""
        n = len(run.payloads)
        self.topic.extend(repeat(marker, n))
        self.partition.extend(repeat(key_group, n))
        self.offset.extend(range(start, start + n))
        self.placed.extend(run.placed)
        self.ts.extend(run.event_ts)
        self.payload.extend(run.payloads)

    def add_columns(
        self, marker: str, key_groups: np.ndarray, offsets: np.ndarray, run: ColumnsHandedOn,
        instances: np.ndarray,
    ) -> None:  # fmt: skip
        """Rows of several key-groups at once (``key_groups``, ``offsets``: this step's)."""
        n = len(offsets)
        columns = {
            "kind": pa.repeat(pa.scalar(RECORD, pa.string()), n),
            "topic": pa.repeat(pa.scalar(marker, pa.string()), n),
            "partition": pa.array(key_groups, pa.int32()),
            "offset": pa.array(offsets, pa.int64()),
            "seq": pa.repeat(pa.scalar(0, pa.int32()), n),
            "instance": pa.array(instances, pa.int32()),
            "key_group": pa.array(run.key_group, pa.int32()),
            "key": run.key,
            "event_ts": run.event_ts,
            "payload": run.payloads,
        }
        self.batches.append(pa.RecordBatch.from_pydict(columns, schema=ENVELOPE_SCHEMA))

    def batch(self) -> pa.RecordBatch:
        batch = self._listed()
        return pa.concat_batches([batch, *self.batches]) if self.batches else batch

    def _listed(self) -> pa.RecordBatch:
        n = len(self.payload)
        # Transposed a column at a time: ``zip(*placed)`` costs 3x as much on long runs.
        keys, groups, instances = (list(map(itemgetter(i), self.placed)) for i in range(3))
        columns = {
            "kind": pa.repeat(pa.scalar(RECORD, pa.string()), n),
            "topic": pa.array(self.topic, pa.string()),
            "partition": pa.array(self.partition, pa.int32()),
            "offset": pa.array(self.offset, pa.int64()),
            "seq": pa.repeat(pa.scalar(0, pa.int32()), n),
            "instance": pa.array(instances, pa.int32()),
            "key_group": pa.array(groups, pa.int32()),
            "key": pa.array(keys, pa.binary()),
            "event_ts": pa.array(self.ts, pa.int64()),
            "payload": pa.array(self.payload, pa.binary()),
        }
        return pa.RecordBatch.from_pydict(columns, schema=ENVELOPE_SCHEMA)


def as_records_give(table: pa.Table) -> pa.Table:
    """``table`` with the column types its rows give as Python records, which a sink
    without a schema infers: integers as int64, floats as float64. So a sink gets the same
    types whether a batch's output came as columns or as records (a join falls back to
    records for a batch it cannot take as columns)."""
    wider = {
        name: pa.int64() if pa.types.is_integer(t) else pa.float64()
        for name, t in zip(table.column_names, table.schema.types, strict=True)
        if (pa.types.is_integer(t) and t != pa.int64() and t != pa.uint64())
        or (pa.types.is_floating(t) and t != pa.float64())
    }
    if not wider:
        return table
    return table.cast(pa.schema([
        pa.field(f.name, wider.get(f.name, f.type), f.nullable) for f in table.schema
    ]))  # fmt: skip


def _in_group_runs(groups: np.ndarray) -> np.ndarray:
    """The rows' positions in runs per key-group, runs in the order of their first rows
    (the order :meth:`Router.emit_keyed_rows` hands rows on in)."""
    _, firsts, inverse = np.unique(groups, return_index=True, return_inverse=True)
    return np.lexsort((np.arange(len(groups)), firsts[inverse]))


def _numbered(groups: np.ndarray, count: list[int]) -> np.ndarray:
    """Each row's offset in its key-group (``groups``), numbered on from ``count`` (rows
    handed on per key-group so far, updated) in the rows' order, as row by row."""
    n = len(groups)
    order = np.argsort(groups, kind="stable")
    ordered = groups[order]
    firsts = np.flatnonzero(np.r_[True, ordered[1:] != ordered[:-1]]) if n else order
    sizes = np.diff(np.r_[firsts, n])
    rank = np.arange(n) - np.repeat(firsts, sizes)
    base = np.asarray(count, dtype=np.int64)[ordered]
    offsets = np.empty(n, dtype=np.int64)
    offsets[order] = base + rank
    for group, size in zip(ordered[firsts].tolist(), sizes.tolist(), strict=True):
        count[group] += size
    return offsets


def _windowed(fn: Any) -> bool:
    return bool(getattr(fn, "columnar", False))


def _json(record: Any) -> bytes:
    return json.dumps(record, default=str).encode()
