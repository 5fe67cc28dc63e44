"""Stage 1 of a batch, inside Spark tasks: Kafka rows → decoded, keyed envelope rows.

Each Kafka record becomes one envelope row (:mod:`.envelope`): a keyed ``record`` or a
``dead_letter`` with its reason, never both, never neither; enrichment inputs not done by
the task's deadline become ``pending`` rows; every task ends with its ``stat`` rows.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import time
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, cast

import pyarrow as pa

from microbatch.errors import MicrobatchError, ProcessError, error_text
from microbatch.gcpause import freeze_in_spark_worker, gc_paused
from microbatch.kafka.confluent_reader import check_confluent
from microbatch.kafka.native_reader import check_native
from microbatch.kafka.reader import read_descriptors
from microbatch.keygroups import encode_key, key_group_of_bytes, operator_indexes
from microbatch.runtime.column_plan import columnar_values, decoded_as_columns
from microbatch.runtime.column_records import records_from_columns
from microbatch.runtime.column_taps import tap_envelopes
from microbatch.runtime.columnar import KnownKeys, columnar_envelopes
from microbatch.runtime.columns import ColumnStep
from microbatch.runtime.decoding import (
    MAX_EPOCH_MS,
    MIN_EPOCH_MS,
    event_time_ms,
    source_decoder,
)
from microbatch.runtime.envelope import (
    OUTPUT,
    PENDING,
    SOURCE_COLUMNS,
    EnvelopeBuilder,
    encode_payload,
    unkeyed_instance,
)
from microbatch.runtime.faults import crash_if
from microbatch.runtime.graph import (
    Edge,
    edges_from,
    first_uid,
    marker,
    source_of_topic,
    step_order,
)
from microbatch.runtime.graph_partials import Reduction, reducing_windows
from microbatch.runtime.pipeline import KafkaSource, Pipeline, input_of
from microbatch.runtime.routed_runs import Placed, routed_rows
from microbatch.runtime.schema import SCHEMA_MISMATCH, SchemaMismatch
from microbatch.runtime.steps import (
    Chain,
    Stateless,
    StepFailed,
    Tap,
    filters_only,
    run_chain,
    sink_only,
)
from microbatch.runtime.tombstones import sources_of
from microbatch.runtime.wire import tags_of

if TYPE_CHECKING:
    from microbatch.enrich import Output

_KEYS_REMEMBERED = 100_000  # string keys whose bytes and key-group a task keeps


@dataclasses.dataclass(frozen=True)
class _Route:
    """Where a source's records go in a dataflow graph: ``edge`` into its target step,
    rows marked ``marker`` (None: the first step's, which keep their topic); records
    behind ``late_before`` are dead letters ``late`` (None: the step takes them)."""

    edge: Edge
    marker: str | None
    late_before: int | None
    #: For a window that stage 1 reduces: how (:mod:`.graph_partials`).
    reduce: Reduction | None = None

    @property
    def field(self) -> str | None:
        return None if callable(self.edge.key_by) else self.edge.key_by


def takes_late(fn: Any) -> bool:
    """Does a keyed step's function decide itself about records behind the watermark
    (windows, joins) rather than have stage 1 dead-letter them?"""
    return bool(getattr(fn, "columnar", False) or getattr(fn, "late_records", False))


class _Bad(Exception):
    def __init__(self, reason: str, error: str) -> None:
        super().__init__(error)
        self.reason = reason
        self.error = error


def _json_bytes(value: Any) -> bytes:
    return json.dumps(value, sort_keys=True, default=str).encode()


@dataclasses.dataclass(frozen=True)
class StageOne:
    """The picklable stage-1 function: Kafka rows (``KAFKA_SCHEMA``) in, envelope rows out.

    It only processes — decode, enrich, key, route — whatever read the rows: Spark's Kafka
    source in the JVM, kafka-python in the same task (:class:`ReadingStageOne`), or the
    driver (re-issued pending elements). It holds what it needs from the driver, nothing
    else."""

    pipeline: Pipeline
    parallelism: int
    watermark: int | None
    crash_at: str | None = None
    #: The rows are the pending elements of the last checkpoint (``value`` holds each
    #: one's bytes), re-issued first, in their own tasks, not Kafka records.
    reissued: bool = False
    #: Reduce a window's records to partials before the exchange (``runtime.windowed``);
    #: None: decided from the pipeline when made (on the driver: the tasks follow).
    pre_aggregate: bool | None = None
    #: The uids of a dataflow graph's windows whose records it reduces
    #: (:mod:`.graph_partials`); None: decided when made, as ``pre_aggregate``.
    reduced_windows: frozenset[str] | None = None

    def __post_init__(self) -> None:
        if self.pre_aggregate is None:
            from microbatch.runtime.windowed import pre_aggregation

            chosen = pre_aggregation(self.pipeline) is not None
            object.__setattr__(self, "pre_aggregate", chosen)
        if self.reduced_windows is None:
            reduced = frozenset(reducing_windows(self.pipeline))
            object.__setattr__(self, "reduced_windows", reduced)

    @functools.cached_property
    def _instance_of(self) -> tuple[int, ...]:
        """The operator instance of each key-group, computed once per task."""
        return operator_indexes(self.pipeline.max_parallelism, self.parallelism)

    @functools.cached_property
    def _late_before(self) -> int | None:
        """Records with an event time behind it are late (dead letters ``late``). A
        windowed pipeline has none: its window operator drops a record only when every
        window of the record had closed (``late_window``), as Flink's and Spark's windows
        do, so a record behind the watermark still counts in a window that is open."""
        return None if takes_late(self.pipeline.process) else self.watermark

    @functools.cached_property
    def _source_taps(self) -> dict[str, tuple[Tap, ...]]:
        """Per topic: the sinks fed before the first keyed step that take its records."""
        pipeline = self.pipeline
        return {
            topic: tuple(t for t in pipeline.source_taps if t.source in (None, i))
            for topic, i in source_of_topic(pipeline).items()
        }

    @functools.cached_property
    def _routes(self) -> dict[str, tuple[_Route, ...]]:
        """Per topic of a dataflow graph (``pipeline.edges``): where its records go."""
        pipeline = self.pipeline
        first = first_uid(pipeline)
        functions = dict(
            zip(step_order(pipeline), (pipeline.process, *(s.process for s in pipeline.steps)),
                strict=True)
        )  # fmt: skip
        reduce = {  # the windows the driver chose to reduce
            uid: Reduction(cast(Any, functions[uid]).operator, self.watermark, self._instance_of)
            for uid in self.reduced_windows or ()
        }
        return {
            topic: tuple(
                _Route(
                    e,
                    None if e.target == first else marker(i, e.target, topic),
                    None if takes_late(functions[e.target]) else self.watermark,
                    reduce.get(e.target),
                )
                for e in edges_from(pipeline, i)
            )
            for topic, i in source_of_topic(pipeline).items()
        }

    @functools.cached_property
    def _sinks_only(self) -> bool:
        return sink_only(self.pipeline)

    @functools.cached_property
    def _decoder(self) -> Any:
        return source_decoder(self.pipeline)

    @functools.cached_property
    def _str_keys(self) -> dict[str, tuple[bytes, int]]:
        """(key bytes, key-group) of the string keys seen in this task: a key repeats."""
        return {}

    @functools.cached_property
    def _known_keys(self) -> dict[str, KnownKeys]:
        """Per Arrow key type: the distinct keys of the columnar path seen in this task."""
        return {}

    @functools.cached_property
    def _key_field(self) -> Any:
        """``key_by`` when it names a field (the common case, looked up inline), else None."""
        key_by = self.pipeline.key_by
        return None if callable(key_by) else key_by

    def keyed(self, record: Any, route: _Route | None = None) -> tuple[bytes, int, int | None]:
        """(key bytes, key-group, event time) of a decoded record, or raise ``_Bad``;
        ``route``: keyed for that edge of a dataflow graph (else the first step's key)."""
        if route is None:
            field, key_of, late_before, step = (
                self._key_field, self.pipeline.key_of, self._late_before, ""
            )  # fmt: skip
        else:
            field, key_of, late_before = route.field, route.edge.key_of, route.late_before
            step = f"step {route.edge.target!r}: "
        if field is not None and type(record) is dict:  # what key_of does, minus two calls
            key = record.get(field)
        else:
            try:
                key = key_of(record)
            except Exception as e:  # user code: a dead letter, with the cause
                raise _Bad("bad_key", f"{step}key_by raised {error_text(e)}") from e
        if key is None:
            key_by = self.pipeline.key_by if route is None else route.edge.key_by
            raise _Bad("missing_key", f"{step}key_by {key_by!r} gave no key")
        if type(key) is str:  # exactly str: no subclass, no 1 == True == 1.0 aliasing
            known = self._str_keys.get(key)
            if known is None:
                if len(self._str_keys) >= _KEYS_REMEMBERED:
                    self._str_keys.clear()
                known = self._str_keys[key] = self._key_and_group(key)
            key_bytes, kg = known
        else:
            key_bytes, kg = self._key_and_group(key)
        ts = None
        et = self.pipeline.event_time
        if et is not None:
            raw = record.get(et.field) if isinstance(record, dict) else None
            if raw is None:
                raise _Bad("missing_event_time", f"record has no event-time field {et.field!r}")
            if type(raw) is int and MIN_EPOCH_MS <= raw <= MAX_EPOCH_MS:  # the common case, inline
                ts = raw
            else:
                try:
                    ts = event_time_ms(raw)
                except (ValueError, TypeError, OverflowError) as e:
                    raise _Bad("bad_event_time", f"field {et.field!r}: {e}") from e
            if late_before is not None and ts < late_before:
                raise _Bad(
                    "late",
                    f"event time {ts} is behind the watermark {self.watermark} "
                    f"(allowed lateness {et.allowed_lateness_s}s)",
                )
        return key_bytes, kg, ts

    def _key_and_group(self, key: Any) -> tuple[bytes, int]:
        try:
            key_bytes = encode_key(key)
        except MicrobatchError as e:
            raise _Bad("bad_key", str(e)) from e
        return key_bytes, key_group_of_bytes(key_bytes, self.pipeline.max_parallelism)

    @functools.cached_property
    def _placed_keys(self) -> dict[Any, Placed]:
        """(key bytes, key-group, instance) of the ``str``/``int`` keys a graph's runs met."""
        return {}

    def _place(self, key: Any) -> Placed:
        key_bytes = encode_key(key)
        kg = key_group_of_bytes(key_bytes, self.pipeline.max_parallelism)
        return key_bytes, kg, self._instance_of[kg]

    def routes_in_runs(self, topic: str) -> bool:
        """Can a run of ``topic``'s records go through the graph's routes at once
        (:mod:`.routed_runs`)? When they meet no sink before the first keyed step."""
        pipeline = self.pipeline
        return bool(pipeline.edges) and not self._sinks_only and not self._source_taps.get(topic)

    def add_run(
        self,
        out: EnvelopeBuilder,
        topic: str,
        parts: Sequence[int],
        offs: Sequence[int],
        seqs: Sequence[int],
        records: Sequence[Any],
    ) -> bool:
        """:meth:`add_records` of each record at once (:meth:`routes_in_runs` must hold);
        False, with nothing added, when some record needs the record-by-record path."""
        if len(self._placed_keys) >= _KEYS_REMEMBERED:
            self._placed_keys.clear()
        et = self.pipeline.event_time
        counted: list[pa.RecordBatch] = []
        rows = routed_rows(
            self._routes[topic], topic, parts, offs, seqs, records,
            time_field=None if et is None else et.field, known=self._placed_keys,
            place=self._place, counted=counted,
        )  # fmt: skip
        if rows is None:
            return False
        out.rows.extend(rows)
        out.counted.extend(counted)
        return True

    @functools.cached_property
    def _inputs(self) -> dict[str, tuple[Any, Any, tuple[Any, ...]]]:
        """Per topic of several sources: (value schema, decoder, stateless prefix)."""
        return {
            topic: (i.source.value_schema, source_decoder(i.source), i.prefix)
            for topic, i in input_of(self.pipeline).items()
        }

    @functools.cached_property
    def has_prefix(self) -> bool:
        """Do records go through stateless steps (or several sources' own, or sinks fed
        before the first keyed step, or a graph's edges: a source may feed several keyed
        steps) in stage 1?"""
        pipeline = self.pipeline
        return bool(pipeline.prefix or pipeline.inputs or pipeline.source_taps or pipeline.edges)

    def prefix_of(self, topic: str) -> Sequence[Stateless]:
        if self.pipeline.inputs:
            return self._inputs[topic][2]
        return self.pipeline.prefix

    @functools.cached_property
    def _plain_decoder(self) -> Any:
        """The decoder when :meth:`decode` is only a call of it: one source, no declared
        schema (None otherwise)."""
        if self.pipeline.inputs or self.pipeline.source.value_schema is not None:
            return None
        return self._decoder

    def decode(self, value: bytes | None, topic: str | None = None) -> Any:
        if value is None:
            raise _Bad("undecodable", "record has no value (tombstone)")
        schema, decoder = self.pipeline.source.value_schema, self._decoder
        if self.pipeline.inputs:
            schema, decoder, _ = self._inputs[topic or ""]
        if schema is not None:  # with enrichment: records stay Python, checked one by one
            try:
                return schema.decode_record(value)
            except SchemaMismatch as e:
                raise _Bad(SCHEMA_MISMATCH, str(e)) from e
        try:
            return decoder(value)
        except Exception as e:
            raise _Bad("undecodable", error_text(e)) from e

    def __call__(self, batches: Iterable[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        """mapInArrow body: Kafka rows in, envelope rows out (same count, minus none), as
        they cross the exchange (:mod:`.wire`)."""
        freeze_in_spark_worker()
        tags = tags_of(self.pipeline)
        return (tags.to_wire(batch) for batch in self.envelope_batches(batches))

    def envelope_batches(self, batches: Iterable[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        """Kafka rows in, envelope rows out, with ``kind`` and ``topic`` as strings: what
        a stage 2 in the same task takes (:mod:`.one_stage`)."""
        where = f"pipeline {self.pipeline.name!r} stage 1"
        if self.pipeline.enrich is None:
            for batch in batches:
                yield self.envelopes(batch)
                crash_if(self.crash_at, "during_read", where)
            return
        with gc_paused():  # a Kafka read in this task too: it allocates as much as the rest
            out = self.enriched(list(batches))
        yield out
        crash_if(self.crash_at, "during_read", where)

    def envelopes(self, batch: pa.RecordBatch) -> pa.RecordBatch:
        if columnar_values(self.pipeline) is not None:
            with gc_paused():  # a window's Python partials (collect, custom) are built here
                if sink_only(self.pipeline):
                    return tap_envelopes(self, batch)
                return columnar_envelopes(self, batch)
        if self.column_sources:
            with gc_paused():
                return records_from_columns(self, batch)
        out = EnvelopeBuilder()
        topics, parts = batch.column("topic").to_pylist(), batch.column("partition").to_pylist()
        with gc_paused():
            self.add_rows(out, topics, parts, *_source_columns(batch, SOURCE_COLUMNS[2:]))
            built = out.build(Counter(zip(topics, parts, strict=True)), self.parallelism)
            del out  # its row tuples freed while paused (see microbatch.gcpause)
        return built

    @functools.cached_property
    def column_sources(self) -> dict[int, tuple[ColumnStep, ...]]:
        """Per source index decoded as columns before its rows become records (a dataflow
        of several sources or a graph): the column steps its rows go through."""
        return decoded_as_columns(self.pipeline)

    def add_rows(
        self, out: EnvelopeBuilder, topics: list[str], parts: list[int], offs: list[int],
        rkeys: list[bytes | None], rvalues: list[bytes | None],
    ) -> None:  # fmt: skip
        """Kafka rows, record by record: decoded, through the stateless steps, keyed (or,
        in a dataflow graph, all at once when none of them needs a second look)."""
        if self._decoded_as_run(out, topics, parts, offs, rvalues):
            return
        filters, has_prefix, plain = self._plain_filters, self.has_prefix, self._plain_decoder
        for topic, part, off, rkey, rvalue in zip(topics, parts, offs, rkeys, rvalues, strict=True):
            try:
                if rvalue is not None and plain is not None:  # :meth:`decode`, inline
                    try:
                        record = plain(rvalue)
                    except Exception as e:
                        raise _Bad("undecodable", error_text(e)) from e
                elif rvalue is None and topic in self._tombstone_sources:
                    self.add_tombstone(out, topic, part, off, rkey)
                    continue
                else:
                    record = self.decode(rvalue, topic)
                if filters is not None:
                    if self.passes(filters, record, topic, part, off):
                        self.add_record(out, topic, part, off, 0, record, raw=rvalue)
                elif has_prefix:
                    self.add_records(out, topic, part, off, record, raw=rvalue)
                else:
                    self.add_record(out, topic, part, off, 0, record, raw=rvalue)
            except _Bad as bad:
                out.dead(topic, part, off, self.parallelism, bad.reason, bad.error,
                         rkey, rvalue)  # fmt: skip

    def _decoded_as_run(
        self,
        out: EnvelopeBuilder,
        topics: list[str],
        parts: list[int],
        offs: list[int],
        rvalues: list[bytes | None],
    ) -> bool:
        """A batch of one topic of one plain source, decoded and routed through a graph
        as one run (:meth:`add_run`); False (nothing added) when one of its rows needs
        the record-by-record path (undecodable, a tombstone, a dead letter later on)."""
        plain = self._plain_decoder
        if plain is None or not self.has_prefix or not topics:
            return False
        topic = topics[0]
        if not self.routes_in_runs(topic) or topic in self._tombstone_sources:
            return False
        if topics.count(topic) != len(topics):
            return False
        try:
            records = list(map(plain, rvalues))
        except Exception:  # an undecodable value: its dead letter comes from add_rows
            return False
        return self.add_run(out, topic, parts, offs, [0] * len(records), records)

    @functools.cached_property
    def _plain_filters(self) -> Chain | None:
        """The prefix when it is only filters before the one keyed step of a single
        source, nothing else in stage 1 (no sinks fed before it, no graph): each record
        then either passes with its source bytes or leaves no row, so :meth:`passes`
        decides it without :meth:`add_records`' per-record set-up. Else None."""
        pipeline = self.pipeline
        prefix = pipeline.prefix
        if not prefix or not filters_only(prefix) or pipeline.inputs or pipeline.edges:
            return None
        if pipeline.source_taps or self._sinks_only:
            return None
        return tuple(prefix)

    def passes(self, filters: Chain, record: Any, topic: str, part: int, off: int) -> bool:
        """Does ``record`` pass every filter of ``filters``? What ``run_chain`` decides,
        raising what :meth:`add_records` raises when a filter does."""
        for step in filters:
            try:
                if not step.fn(record):
                    return False
            except Exception as e:  # user code: a dead letter or the batch's failure
                failed = StepFailed(step.name, error_text(e))
                raise self._step_failed(failed, topic, part, off) from e
        return True

    def enriched(self, batches: list[pa.RecordBatch]) -> pa.RecordBatch:
        """Decode a whole task's rows, enrich them until the deadline, key the results.

        Inputs not enriched by the deadline become ``pending`` rows (re-issued next
        batch, through a :attr:`reissued` stage)."""
        from microbatch.enrich import Element, PendingElement, run_batch

        enrich = self.pipeline.enrich
        if enrich is None:
            raise ValueError("enriched() needs a pipeline with enrich=")
        out = EnvelopeBuilder()
        elements: list[Any] = []
        pending: list[Any] = []
        sources = _SourceBytes()
        inputs: Counter[tuple[str, int]] = Counter()
        with gc_paused():
            for batch in batches:
                topics, parts, offs, rkeys, rvalues = _source_columns(batch)
                if self.reissued:  # no new input: restored ahead of everything, in order
                    pending.extend(PendingElement.from_bytes(v) for v in rvalues)
                    continue
                inputs.update(zip(topics, parts, strict=True))
                sources.add(topics, parts, offs, rkeys, rvalues)
                for topic, part, off, rkey, rvalue in zip(
                    topics, parts, offs, rkeys, rvalues, strict=True
                ):
                    try:
                        record = self.decode(rvalue, topic)
                    except _Bad as bad:
                        out.dead(topic, part, off, self.parallelism, bad.reason, bad.error,
                                 rkey, rvalue)  # fmt: skip
                        continue
                    elements.append(Element(record, (topic, part, off)))
            # The deadline counts from the task's start of enrichment, not the driver's
            # clock: scheduling delays must not eat a task's budget.
            deadline = None if enrich.deadline_s is None else time.time() + enrich.deadline_s
            outcome = run_batch(
                enrich.make_operator, elements, pending=pending, deadline_s=deadline
            )
            del elements
            results: list[tuple[str, int, int, int, Any]] = []
            previous, seq = None, 0
            for o in outcome.outputs:
                coords = getattr(o, "coordinates", None)
                if coords is None:  # a watermark: the runtime sends none
                    continue
                # The results of one input leave the operator together: number them.
                seq = seq + 1 if coords == previous else 0
                previous = coords
                value = cast("Output", o).value  # it has coordinates: not a watermark
                results.append((*coords, seq, value))
            if not self._added_as_run(out, results):
                self._add_results(out, results, sources)
            for d in outcome.dead_letters:
                topic, part, off = d.coordinates or ("", 0, 0)
                rkey, rvalue = sources.get((topic, part, off)) or (None, _json_bytes(d.record))
                out.dead(topic, part, off, self.parallelism, f"enrichment_{d.reason}", d.error,
                         rkey, rvalue, attempts=d.attempts)  # fmt: skip
            for p in outcome.pending:
                if p.coordinates is None:
                    continue
                topic, part, off = p.coordinates
                inst = unkeyed_instance(part, off, self.parallelism)  # it passes through stage 2
                out.add(PENDING, topic, part, off, 0, inst, None, None, None, p.to_bytes())
            return out.build(inputs, self.parallelism)

    def _added_as_run(
        self, out: EnvelopeBuilder, results: list[tuple[str, int, int, int, Any]]
    ) -> bool:
        """The enrichment's results routed as one run (:meth:`add_run`), when they are
        of one topic that a dataflow graph routes so; False (nothing added) if not."""
        if not results or not self.has_prefix:
            return False
        topic = results[0][0]
        if not self.routes_in_runs(topic) or any(r[0] != topic for r in results):
            return False
        _, parts, offs, seqs, values = zip(*results, strict=True)
        return self.add_run(out, topic, parts, offs, seqs, values)

    def _add_results(
        self,
        out: EnvelopeBuilder,
        results: list[tuple[str, int, int, int, Any]],
        sources: _SourceBytes,
    ) -> None:
        """The enrichment's results one by one: keyed rows, or dead letters that carry
        their source bytes."""
        for topic, part, off, seq, value in results:
            try:
                if self.has_prefix:
                    self.add_records(out, topic, part, off, value, seq)
                else:
                    self.add_record(out, topic, part, off, seq, value)
            except _Bad as bad:
                rkey, rvalue = sources.get((topic, part, off)) or (None, _json_bytes(value))
                out.dead(topic, part, off, self.parallelism, bad.reason, bad.error,
                         rkey, rvalue, seq=seq)  # fmt: skip

    def add_records(
        self,
        out: EnvelopeBuilder,
        topic: str,
        part: int,
        off: int,
        record: Any,
        seq: int = 0,
        raw: bytes | None = None,
    ) -> None:
        """The pipeline's stateless prefix on ``record``, each result appended as a keyed
        row (numbered after ``seq``); raises ``_Bad`` (nothing appended) if a step raises
        or a result is unfit. A record the prefix filters out leaves no row. ``raw``: the
        source bytes, handed on when the prefix only filters (of a single source)."""
        builder = EnvelopeBuilder()  # all of the record's rows, or none
        self.add_outputs(builder, topic, part, off, record, seq)
        if self._sinks_only:  # no keyed step takes it
            out.rows.extend(builder.rows)
            return
        if self.pipeline.edges:  # a dataflow graph: each edge from this source
            for route in self._routes[topic]:
                try:
                    records = run_chain(route.edge.chain, record)
                except StepFailed as e:
                    raise self._step_failed(e, topic, part, off) from e
                for i, r in enumerate(records):
                    self.add_record(builder, topic, part, off, seq * 1024 + i, r, route=route)
            out.rows.extend(builder.rows)
            return
        prefix = self.prefix_of(topic)
        if raw is not None and not self.pipeline.inputs and filters_only(prefix):
            try:
                kept = run_chain(prefix, record)
            except StepFailed as e:
                raise self._step_failed(e, topic, part, off) from e
            if kept:
                self.add_record(builder, topic, part, off, seq, record, raw=raw)
            out.rows.extend(builder.rows)
            return
        try:
            records = run_chain(prefix, record)
        except StepFailed as e:
            raise self._step_failed(e, topic, part, off) from e
        for i, r in enumerate(records):
            self.add_record(builder, topic, part, off, seq * 1024 + i, r)
        out.rows.extend(builder.rows)

    @functools.cached_property
    def _tombstone_sources(self) -> dict[str, KafkaSource]:
        """Per topic whose source has ``tombstones=True``: that source."""
        return {t: s for s in sources_of(self.pipeline) if s.tombstones for t in s.topics}

    def add_tombstone(
        self, out: EnvelopeBuilder, topic: str, part: int, off: int, kafka_key: bytes | None
    ) -> None:
        """A tombstone as a ``None`` record keyed by its Kafka key, into every step input
        its source feeds (each one takes None as a delete: :mod:`.tombstones`); raises
        ``_Bad`` (nothing appended) if the key is missing or unreadable."""
        source = self._tombstone_sources[topic]
        try:
            key = source.key_of_tombstone(kafka_key)
        except Exception as e:  # user code, or Kafka key bytes that are not UTF-8
            raise _Bad("bad_key", f"tombstone_key raised {error_text(e)}") from e
        if key is None:
            raise _Bad("missing_key", "tombstone has no Kafka key: no key to delete")
        key_bytes, kg = self._key_and_group(key)
        payload = encode_payload(None)
        for route in self._routes[topic]:
            marked = topic if route.marker is None else route.marker
            out.record(marked, part, off, 0, self._instance_of[kg], kg, key_bytes, None, payload)

    def add_outputs(
        self, out: EnvelopeBuilder, topic: str, part: int, off: int, record: Any, seq: int
    ) -> None:
        """The record on its way to the sinks fed before the first keyed step."""
        taps = self._source_taps.get(topic, ())
        if not taps:
            return
        instance = unkeyed_instance(part, off, self.parallelism)
        for tap in taps:
            try:
                records = run_chain(tap.chain, record)
            except StepFailed as e:
                raise self._step_failed(e, topic, part, off) from e
            for i, r in enumerate(records):
                try:
                    payload = encode_payload(r)
                except MicrobatchError as e:
                    raise _Bad("undecodable", f"for sink {tap.sink!r}: not plain data: {e}") from e
                out.add(OUTPUT, topic, part, off, seq * 1024 + i, instance, None,
                        tap.sink.encode(), None, payload)  # fmt: skip

    def _step_failed(self, e: StepFailed, topic: str, part: int, off: int) -> Exception:
        """What a failed stateless step raises: the batch's failure, or a dead letter."""
        if self.pipeline.on_process_error == "fail":
            return ProcessError(
                f"pipeline {self.pipeline.name!r} stage 1: {e} on {topic}[{part}]@{off}. "
                "Fix the function, or set on_process_error='dead_letter'."
            )
        return _Bad("step_failed", str(e))

    def add_record(
        self,
        out: EnvelopeBuilder,
        topic: str,
        part: int,
        off: int,
        seq: int,
        record: Any,
        raw: bytes | None = None,
        route: _Route | None = None,
    ) -> None:
        """Append ``record`` as a keyed row; raises ``_Bad`` (nothing appended) if unfit.

        ``raw``: the record's source bytes, carried instead of re-encoding the record when
        stage 2 can decode them again (no enrichment changed it). ``route``: the edge of a
        dataflow graph it takes."""
        key_bytes, kg, ts = self.keyed(record, route)
        if raw is not None:
            payload = raw
        else:
            try:
                payload = encode_payload(record)
            except MicrobatchError as e:
                raise _Bad("undecodable", f"decoded value is not plain data: {e}") from e
        if route is not None and route.marker is not None:
            topic = route.marker
        out.record(topic, part, off, seq, self._instance_of[kg], kg, key_bytes, ts, payload)


#: Records per Arrow batch that stage 1 reads in its own tasks. Each batch has fixed costs
#: (a known-key lookup, a JSON parse, window partials, stat rows); 50k rows instead of the
#: readers' 10k cost 10-25 % less stage-1 CPU on Nexmark's bids (and pre-aggregated
#: windows send fewer partials) for ~10 MB per batch.
READ_BATCH_ROWS = 50_000


@dataclasses.dataclass(frozen=True)
class ReadingStageOne:
    """Stage 1 reading inside its own tasks: the input rows are range descriptors
    (``range_descriptors``); the task reads each range with ``client`` (``"python"``:
    kafka-python, ``"confluent"``: confluent-kafka, ``"native"``: microbatch's native
    reader) and hands the records to ``stage`` as
    they arrive, in one Python worker (not two chained ones)."""

    stage: StageOne
    bootstrap_servers: str
    #: How to connect (``Settings.kafka_client_config``): kafka-python consumer settings.
    consumer_config: dict[str, Any] | None = None
    client: str = "python"
    batch_rows: int = READ_BATCH_ROWS

    def __post_init__(self) -> None:
        if self.client == "confluent":  # on the driver: no task starts only to fail
            check_confluent(self.consumer_config)
        elif self.client == "native":
            check_native(self.consumer_config)

    def __call__(self, batches: Iterable[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        return self.stage(self.read(batches))

    def read(self, batches: Iterable[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        """The Kafka rows of the ranges ``batches`` describe."""
        return read_descriptors(
            batches,
            self.bootstrap_servers,
            client=self.client,
            batch_rows=self.batch_rows,
            consumer_config=self.consumer_config,
            source_only=True,  # stage 1 reads no timestamps or headers
        )


def _source_columns(
    batch: pa.RecordBatch, names: Sequence[str] = SOURCE_COLUMNS
) -> tuple[list[Any], ...]:
    """(topic, partition, offset, key, value) of Kafka rows (or the columns ``names``),
    as Python lists."""
    return tuple(batch.column(name).to_pylist() for name in names)


class _SourceBytes:
    """The source key and value of each input by coordinates (for dead letters); the
    index is built only if a dead letter asks."""

    def __init__(self) -> None:
        self._columns: list[tuple[list[Any], ...]] = []
        self._index: dict[tuple[str, int, int], tuple[bytes | None, bytes | None]] | None = None

    def add(self, topics: list[str], parts: list[int], offs: list[int], keys: list[Any],
            values: list[Any]) -> None:  # fmt: skip
        self._columns.append((topics, parts, offs, keys, values))
        self._index = None

    def get(self, coords: Any) -> tuple[bytes | None, bytes | None] | None:
        if self._index is None:
            self._index = {}
            for topics, parts, offs, keys, values in self._columns:
                where = zip(topics, parts, offs, strict=True)
                self._index.update(zip(where, zip(keys, values, strict=True), strict=True))
        return self._index.get(tuple(coords))
