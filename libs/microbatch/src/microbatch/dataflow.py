"""Dataflows: several operators in one pipeline, written as a chain of steps.

::

    flow = Dataflow("payments", checkpoints="s3://bucket/checkpoints/payments",
                    event_time=EventTime(field="ts"), dead_letters=DeadLetterSink(path=...))
    payments = flow.source(KafkaSource(topics=("payments",)))
    alerts = (
        payments.filter(lambda p: p["amount"] > 0)
        .key_by("card")
        .process(FraudAlerts(), uid="fraud", outputs=[alert_sink])   # ctx.emit(r, to=...)
    )
    alerts.to(flagged_sink)
    alerts.key_by("merchant").process(MerchantRisk(), uid="merchant").to(risk_sink)
    pipeline = flow.build()

Stateless steps (:meth:`Stream.map`, :meth:`~Stream.filter`, :meth:`~Stream.flat_map`)
run where the records already are; each :meth:`Stream.key_by` followed by
:meth:`KeyedStream.process` (or :meth:`~KeyedStream.window`) is one exchange by key-group
and one keyed step with its own state, named by its ``uid`` in the checkpoint. A batch
runs every step in one Spark job and commits every step's state, the offsets and the
output in one manifest.

``build()`` gives the :class:`~microbatch.runtime.Pipeline` that the runner, the CLI and
the Airflow DAGs take; a job file may also name the :class:`Dataflow` itself. What a
dataflow can not be is refused there, naming the step: a sink fed twice or never, two
steps with one uid, a window without event time or with two inputs.

On a source with a declared ``value_schema``, :meth:`Stream.where` and
:meth:`Stream.select` filter and project the Arrow columns before any record is built
(:mod:`microbatch.runtime.columns`), and a dataflow needs no keyed step at all:
``flow.source(s).where(...).select(...).to(sink)`` sends each sink its rows as columns,
one Arrow table per instance and batch (:mod:`microbatch.runtime.column_taps`). With
several sources, or in a graph, each source may have its own ``where``/``select`` before
its ``key_by``: stage 1 builds records only of the rows kept, with the selected fields.

Steps need not form a chain: a step's output (or a source) may feed several keyed steps,
``union`` merges streams of sources and keyed steps, and :meth:`KeyedStream.join` makes
one keyed step of two keyed streams (:mod:`microbatch.runtime.graph`).
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Literal, cast

import pyarrow.compute as pc

from microbatch.errors import ConfigError
from microbatch.runtime.columns import ColumnStep, output_schema
from microbatch.runtime.graph import Edge
from microbatch.runtime.pipeline import (
    DeadLetterSink,
    Enrichment,
    EventTime,
    Input,
    KafkaSource,
    OnProcessError,
    Pipeline,
    combined_source,
)
from microbatch.runtime.process import KeyedProcessFunction
from microbatch.runtime.steps import (
    Chain,
    KeyedStep,
    NoKeyedStep,
    Stateless,
    StatelessKind,
    Tap,
)
from microbatch.sinks import Sink
from microbatch.validation import check_name

__all__ = ["Dataflow", "KeyedStream", "MissingUidWarning", "Stream"]

Key = str | Callable[[Any], Any]


class MissingUidWarning(UserWarning):
    """A keyed step without ``uid=``: its state is named after its position, so inserting
    a keyed step before it later would hand it another step's state."""


@dataclasses.dataclass(frozen=True)
class _Strand:
    """Records of one origin — a source (its index) or a keyed step — after ``chain``."""

    origin: int | _Keyed
    chain: Chain = ()
    #: Column-wise steps (``where``/``select``) of a source's columns, before ``chain``.
    columns: tuple[ColumnStep, ...] = ()


@dataclasses.dataclass(eq=False)
class _Keyed:
    """A keyed step while the dataflow is being written."""

    uid: str
    process: KeyedProcessFunction
    #: What it reads: (strand, key, side) — side 0, or 1 for a join's other stream.
    inputs: list[tuple[_Strand, Key, int]]
    taps: list[Tap] = dataclasses.field(default_factory=list)


class Dataflow:
    """A pipeline of several steps; everything but the steps is the pipeline's own
    setting (see :class:`~microbatch.runtime.Pipeline`); ``drop_state``: uids of keyed
    steps whose state may go — removed from the dataflow, or now running a function of
    another class (refused otherwise, so that no state is lost by mistake)."""

    def __init__(
        self,
        name: str,
        *,
        checkpoints: str,
        event_time: EventTime | None = None,
        dead_letters: DeadLetterSink | None = None,
        max_parallelism: int = 128,
        parallelism: int = 1,
        on_process_error: OnProcessError = "fail",
        retain_checkpoints: int = 10,
        lease_timeout_s: float = 60.0,
        drop_state: Sequence[str] = (),
    ) -> None:
        check_name("pipeline", name)
        self.name = name
        self._settings: dict[str, Any] = {
            "checkpoints": checkpoints,
            "event_time": event_time,
            "dead_letters": dead_letters,
            "max_parallelism": max_parallelism,
            "parallelism": parallelism,
            "on_process_error": on_process_error,
            "retain_checkpoints": retain_checkpoints,
            "lease_timeout_s": lease_timeout_s,
            "drop_state": tuple(drop_state),
        }
        self._sources: list[KafkaSource] = []
        self._enrich: Enrichment | None = None
        self._steps: list[_Keyed] = []
        self._sinks: list[Sink] = []
        self._source_taps: list[Tap] = []

    def source(self, source: KafkaSource) -> Stream:
        """The stream of a source's records. A dataflow may read several sources, each
        with its own decoding (``decoder`` or ``value_schema``), joined by
        :meth:`Stream.union` before the first keyed step; they are read in one plan, so
        they share ``starting``, the batch limits and the reader."""
        if not isinstance(source, KafkaSource):
            raise ConfigError(f"dataflow {self.name!r}: source must be a KafkaSource: {source!r}")
        self._sources.append(source)
        return Stream(self, (_Strand(len(self._sources) - 1),))

    def build(self) -> Pipeline:
        """The pipeline this dataflow is: checked, ready for the runner. Without a keyed
        step, its first step is a :class:`~microbatch.runtime.steps.NoKeyedStep` that
        gets no record: the sources' records only go to the sinks."""
        where = f"dataflow {self.name!r}"
        if not self._sources:
            raise ConfigError(f"{where}: no source; start with flow.source(KafkaSource(...))")
        if not self._steps:
            return self._sinks_only(where)
        read = {s.origin for step in self._steps for s, _, _ in step.inputs}
        unread = [s for i, s in enumerate(self._sources) if i not in read]
        if unread:
            topics = ", ".join(t for s in unread for t in s.topics)
            raise ConfigError(
                f"{where}: the source of {topics} feeds no keyed step; key it and give it "
                "to one (or union() it with a stream that is)"
            )
        first, *rest = steps = self._run_order()
        several = len(self._sources) > 1
        source = combined_source(self._sources, where) if several else self._sources[0]
        settings = {
            "name": self.name,
            "source": source,
            "enrich": self._enrich,
            "process": first.process,
            "uid": first.uid,
            "taps": tuple(first.taps),
            "source_taps": tuple(self._source_taps),
            "sinks": tuple(self._sinks),
            **self._settings,
        }
        chain = self._as_chain()
        columns = self._column_steps()  # several sources: each in its Input
        settings["column_steps"] = () if several else columns.get(0, ())
        if chain is not None:  # each step reads the one before: no graph needed
            key, prefixes = chain
            inputs = tuple(
                Input(s, prefixes[i], columns.get(i, ())) for i, s in enumerate(self._sources)
            )
            return Pipeline(
                key_by=key,
                prefix=() if several else prefixes[0],
                inputs=inputs if several else (),
                steps=tuple(
                    KeyedStep(s.uid, s.inputs[0][1], s.process, s.inputs[0][0].chain, tuple(s.taps))
                    for s in rest
                ),
                **settings,
            )
        edges = tuple(
            Edge(
                strand.origin if isinstance(strand.origin, int) else strand.origin.uid,
                step.uid,
                key,
                strand.chain,
                side,
            )
            for step in steps
            for strand, key, side in step.inputs
        )
        inputs = tuple(Input(s, columns=columns.get(i, ())) for i, s in enumerate(self._sources))
        return Pipeline(
            key_by=first.inputs[0][1],
            inputs=inputs if several else (),
            steps=tuple(
                KeyedStep(s.uid, s.inputs[0][1], s.process, (), tuple(s.taps)) for s in rest
            ),
            edges=edges,
            **settings,
        )

    def _run_order(self) -> list[_Keyed]:
        """The keyed steps in the order a batch runs them: by depth (a step fed only by
        sources first), then as defined. Each step's input rows ride through the
        exchanges of the steps run between it and the step that made them: a branch off
        a source runs before the steps chained after another branch, so its records cross
        one exchange less for each of those."""
        depth: dict[str, int] = {}
        for step in self._steps:  # defined after what feeds it: its inputs' depths are known
            fed_by = [s.origin.uid for s, _, _ in step.inputs if not isinstance(s.origin, int)]
            depth[step.uid] = 1 + max((depth[uid] for uid in fed_by), default=0)
        return sorted(self._steps, key=lambda step: depth[step.uid])

    def _sinks_only(self, where: str) -> Pipeline:
        """A dataflow without keyed steps — source, stateless steps, sinks — as a pipeline
        whose first step takes nothing (:class:`~microbatch.runtime.steps.NoKeyedStep`):
        stage 1 sends the records to the sinks, the instances stage them."""
        if not self._source_taps:
            raise ConfigError(
                f"{where}: no keyed step and no sink; send the stream to a sink with "
                ".to(sink), or add .key_by(...).process(...)"
            )
        if len(self._sources) > 1:
            raise ConfigError(
                f"{where}: a dataflow without keyed steps reads one source (several: not "
                "supported yet); key and union them, or write one dataflow per source"
            )
        return Pipeline(
            name=self.name,
            source=self._sources[0],
            enrich=self._enrich,
            process=NoKeyedStep(),
            taps=(),
            source_taps=tuple(self._source_taps),
            sinks=tuple(self._sinks),
            **self._settings,
        )

    def _column_steps(self) -> dict[int, tuple[ColumnStep, ...]]:
        """Each source's column steps, those of every stream of it a keyed step reads;
        refused, naming the source and the step, when two such streams differ (stage 1
        decodes a source's rows once, through its column steps, before it keys them for
        each step it feeds)."""
        found: dict[int, tuple[ColumnStep, ...]] = {}
        for step in self._steps:
            for strand, _, _ in step.inputs:
                if not isinstance(strand.origin, int):
                    continue
                before = found.setdefault(strand.origin, strand.columns)
                odd = _first_difference(before, strand.columns)
                if odd is not None:
                    raise ConfigError(
                        f"dataflow {self.name!r}: {self._origin_name(strand.origin)} feeds keyed "
                        f"steps through different column steps ({odd.kind} step {odd.name!r} "
                        "is where they part); give every key_by of a source the same "
                        "where()/select() (stage 1 runs a source's column steps once)"
                    )
        return {i: c for i, c in found.items() if c}

    def _as_chain(self) -> tuple[Key, dict[int, Chain]] | None:
        """(the first step's key, each source's stateless steps) when the keyed steps form
        a chain — the first reads every source with one key, each other step reads only
        the step before — else None (the pipeline then carries its graph's edges)."""
        first, *rest = self._steps
        keys = {id(key) for _, key, _ in first.inputs}
        if len(keys) != 1 or len(first.inputs) != len(self._sources):
            return None
        if any(side for _, _, side in first.inputs):
            return None
        for before, step in zip(self._steps, rest, strict=False):
            if len(step.inputs) != 1:
                return None
            strand, _, side = step.inputs[0]
            if strand.origin is not before or side:
                return None
        prefixes = {s.origin: s.chain for s, _, _ in first.inputs}
        return first.inputs[0][1], cast("dict[int, Chain]", prefixes)  # origins: sources

    def _add_step(self, step: _Keyed) -> None:
        if any(s.uid == step.uid for s in self._steps):
            raise ConfigError(
                f"dataflow {self.name!r}: two keyed steps have the uid {step.uid!r}; give "
                "each its own"
            )
        self._steps.append(step)

    def _add_sink(self, sink: Sink) -> None:
        if not isinstance(sink, Sink):
            raise ConfigError(f"dataflow {self.name!r}: not a sink: {sink!r}")
        if any(s.name == sink.name for s in self._sinks):
            raise ConfigError(
                f"dataflow {self.name!r}: the sink name {sink.name!r} is used twice; a sink "
                "takes the records of one step"
            )
        self._sinks.append(sink)

    def _origin_name(self, origin: int | _Keyed) -> str:
        if isinstance(origin, int):
            return f"the source of {list(self._sources[origin].topics)}"
        return f"step {origin.uid!r}"

    def _default_uid(self, process: Any) -> str:
        uid = f"{type(process).__name__.lower()}-{len(self._steps) + 1}"
        warnings.warn(
            f"dataflow {self.name!r}: a keyed step has no uid; its state is named {uid!r} "
            "after its position. Set uid= so that its state stays its own when the "
            "dataflow changes.",
            MissingUidWarning,
            stacklevel=3,
        )
        return uid


def _first_difference(
    one: tuple[ColumnStep, ...], other: tuple[ColumnStep, ...]
) -> ColumnStep | None:
    """The first column step at which ``one`` and ``other`` part (None: the same steps)."""
    for i in range(max(len(one), len(other))):
        a = one[i] if i < len(one) else None
        b = other[i] if i < len(other) else None
        if a is not b:
            return a if a is not None else b
    return None


class Stream:
    """Records flowing out of sources or keyed steps, after stateless steps."""

    def __init__(self, flow: Dataflow, strands: tuple[_Strand, ...]) -> None:
        self._flow = flow
        self._strands = strands

    def _then(self, kind: StatelessKind, fn: Callable[[Any], Any], name: str | None) -> Stream:
        n = max(len(s.chain) for s in self._strands) + 1
        origins = [s.origin for s in self._strands]
        if all(isinstance(o, int) for o in origins):
            after = "source"
        else:
            after = cast(_Keyed, origins[0]).uid if len(origins) == 1 else "union"
        step = Stateless(kind, fn, name or f"{after}.{kind}-{n}")
        strands = (dataclasses.replace(s, chain=(*s.chain, step)) for s in self._strands)
        return Stream(self._flow, tuple(strands))

    def where(self, condition: pc.Expression, *, name: str | None = None) -> Stream:
        """Keep the rows where ``condition`` (a :class:`pyarrow.compute.Expression` on the
        declared schema's columns, e.g. ``pc.field("price") > 10``) is true; a null is not
        true. Runs on the Arrow columns in stage 1, before any record is built: only on a
        source with a ``value_schema`` (any of several), before record-wise and keyed
        steps, ``union`` and ``join``."""
        if not isinstance(condition, pc.Expression):
            raise ConfigError(
                f"dataflow {self._flow.name!r}: where() takes a pyarrow.compute.Expression "
                f"such as pc.field('price') > 10, got {condition!r}; for a Python function "
                "use filter()"
            )
        return self._column_step("where", name, condition=condition)

    def select(self, *names: str, **computed: pc.Expression) -> Stream:
        """Keep the columns ``names`` (in that order) and append a column per keyword, the
        value of a :class:`pyarrow.compute.Expression` (e.g. ``select("auction",
        price=pc.field("price") * 0.908)``). Column-wise, like :meth:`where`."""
        where = f"dataflow {self._flow.name!r}"
        bad = [n for n in names if not isinstance(n, str) or not n]
        if bad or not (names or computed):
            raise ConfigError(f"{where}: select() takes column names and name=expression")
        for column, expr in computed.items():
            if not isinstance(expr, pc.Expression):
                raise ConfigError(
                    f"{where}: select() column {column!r} must be a pyarrow.compute.Expression"
                    f", got {expr!r} (a constant: pc.scalar(value))"
                )
        return self._column_step(
            "select", None, names=tuple(names), computed=tuple(computed.items())
        )

    def _column_step(self, kind: Literal["where", "select"], name: str | None,
                     **how: Any) -> Stream:  # fmt: skip
        """A column step after this stream's, checked on the source's declared schema."""
        flow = self._flow
        (strand,) = self._strands if len(self._strands) == 1 else (None,)
        name = name or f"source.{kind}-{len(strand.columns) + 1 if strand else 1}"
        refuse = f"dataflow {flow.name!r}: {kind} step {name!r}"
        if strand is None or not isinstance(strand.origin, int):
            raise ConfigError(
                f"{refuse}: column steps run on one source's columns, right after "
                "flow.source(...); not after a keyed step or on a union"
            )
        if strand.chain:
            raise ConfigError(
                f"{refuse}: comes after the record-wise step {strand.chain[-1].name!r}; "
                "put where()/select() before map/filter/flat_map"
            )
        schema = flow._sources[strand.origin].value_schema
        if schema is None:
            raise ConfigError(
                f"{refuse}: column steps need the source's declared schema: "
                "KafkaSource(..., value_schema=JsonSchema({...}))"
            )
        if flow._enrich is not None:
            raise ConfigError(f"{refuse}: column steps do not run after enrich()")
        columns = (*strand.columns, ColumnStep(kind, name, **how))
        output_schema(columns, schema.arrow_schema, f"dataflow {flow.name!r}")
        return Stream(flow, (dataclasses.replace(strand, columns=columns),))

    def union(self, *others: Stream) -> Stream:
        """One stream of this one's records and ``others``': of sources or keyed steps,
        each after its own stateless steps. The next keyed step reads them all, keyed by
        one ``key_by``."""
        strands = list(self._strands)
        for other in others:
            if not isinstance(other, Stream) or other._flow is not self._flow:
                raise ConfigError(
                    f"dataflow {self._flow.name!r}: union() takes streams of this dataflow"
                )
            for strand in other._strands:
                if any(s.origin is strand.origin for s in strands):
                    raise ConfigError(
                        f"dataflow {self._flow.name!r}: {self._flow._origin_name(strand.origin)}"
                        " is in the union twice"
                    )
                strands.append(strand)
        return Stream(self._flow, tuple(strands))

    def map(self, fn: Callable[[Any], Any], *, name: str | None = None) -> Stream:
        """Each record becomes ``fn(record)``."""
        return self._then("map", fn, name)

    def filter(self, fn: Callable[[Any], bool], *, name: str | None = None) -> Stream:
        """Keep the records for which ``fn(record)`` is true."""
        return self._then("filter", fn, name)

    def flat_map(self, fn: Callable[[Any], Iterable[Any]], *, name: str | None = None) -> Stream:
        """Each record becomes the records of ``fn(record)`` (none, one or several)."""
        return self._then("flat_map", fn, name)

    def enrich(self, enrichment: Enrichment) -> Stream:
        """Async I/O enrichment of the source's records (``microbatch.enrich``): right
        after the source, before other steps."""
        flow = self._flow
        fresh = len(self._strands) == 1 and self._strands[0] == _Strand(0)
        if not fresh or flow._enrich is not None or len(flow._sources) != 1:
            raise ConfigError(
                f"dataflow {flow.name!r}: enrich() goes right after source(), once, with "
                "one source; enriching after other steps is not supported yet"
            )
        if not isinstance(enrichment, Enrichment):
            raise ConfigError(f"dataflow {flow.name!r}: enrich() takes an Enrichment")
        flow._enrich = enrichment
        return self

    def key_by(self, key: Key) -> KeyedStream:
        """Key the records by a field name or a function: the next step is keyed."""
        if not (isinstance(key, str) and key) and not callable(key):
            raise ConfigError(
                f"dataflow {self._flow.name!r}: key_by takes a field name or a function, "
                f"got {key!r}"
            )
        return KeyedStream(self, key)

    def to(self, sink: Sink) -> Stream:
        """Send these records to ``sink`` too; returns this stream (to go on from it)."""
        flow = self._flow
        if len(self._strands) != 1:
            raise ConfigError(
                f"dataflow {flow.name!r}: sink {sink.name!r} takes the records of one step; "
                "send each stream of the union to its own sink, or key the union first"
            )
        (strand,) = self._strands
        if isinstance(strand.origin, int):
            flow._add_sink(sink)
            tap = Tap(sink.name, strand.chain, source=strand.origin, columns=strand.columns)
            flow._source_taps.append(tap)
        else:
            flow._add_sink(sink)
            strand.origin.taps.append(Tap(sink.name, strand.chain))
        return self


class KeyedStream:
    """A stream keyed for its next step."""

    def __init__(self, stream: Stream, key: Key) -> None:
        self._stream = stream
        self._key = key

    def process(
        self,
        fn: KeyedProcessFunction,
        *,
        uid: str | None = None,
        outputs: Sequence[Sink] = (),
    ) -> Stream:
        """A keyed step: ``fn.process(key, records, ctx)`` per key and batch, with its
        own state and timers. Its output stream is what ``ctx.emit(record)`` sends;
        ``outputs``: sinks that take only ``ctx.emit(record, to=<sink name>)``."""
        inputs = [(strand, self._key, 0) for strand in self._stream._strands]
        return self._step(fn, uid, outputs, inputs, "process")

    def join(
        self,
        other: KeyedStream,
        fn: KeyedProcessFunction,
        *,
        uid: str | None = None,
        outputs: Sequence[Sink] = (),
    ) -> Stream:
        """A keyed step reading two streams, each keyed by its own ``key_by`` (keys of one
        value meet in one call): ``fn.process(key, records, ctx)`` gets each record as a
        :class:`~microbatch.runtime.process.Sided` — side 0 from this stream, 1 from
        ``other``. ``fn`` is a join of :mod:`microbatch.joins` or a function of yours."""
        flow = self._stream._flow
        if not isinstance(other, KeyedStream) or other._stream._flow is not flow:
            raise ConfigError(
                f"dataflow {flow.name!r}: join() takes a keyed stream of this dataflow "
                "(stream.key_by(...))"
            )
        mine = {id(s.origin) for s in self._stream._strands}
        if any(id(s.origin) in mine for s in other._stream._strands):
            raise ConfigError(
                f"dataflow {flow.name!r}: join() of a stream with itself; give the other side "
                "its own source or step"
            )
        inputs = [(s, self._key, 0) for s in self._stream._strands]
        inputs += [(s, other._key, 1) for s in other._stream._strands]
        return self._step(fn, uid, outputs, inputs, "join")

    def _step(
        self,
        fn: KeyedProcessFunction,
        uid: str | None,
        outputs: Sequence[Sink],
        inputs: list[tuple[_Strand, Key, int]],
        what: str,
    ) -> Stream:
        flow = self._stream._flow
        if not isinstance(fn, KeyedProcessFunction):
            raise ConfigError(
                f"dataflow {flow.name!r}: {what}() takes a KeyedProcessFunction instance, "
                f"got {fn!r}"
            )
        sides = len({side for _, _, side in inputs})
        wants = getattr(fn, "inputs", None)
        if wants is not None and wants != sides:
            how = "a.key_by(...).join(b.key_by(...), fn)" if wants == 2 else "process(fn)"
            raise ConfigError(
                f"dataflow {flow.name!r}: {type(fn).__name__} takes {wants} input(s), but "
                f"{what}() gives it {sides}; use {how}"
            )
        if getattr(fn, "needs_event_time", False) and flow._settings["event_time"] is None:
            raise ConfigError(
                f"dataflow {flow.name!r}: {type(fn).__name__} needs event time (its state is "
                "dropped as the watermark passes): set Dataflow(..., event_time=EventTime(...))"
            )
        if uid is None:
            uid = flow._default_uid(fn)
        check_name("step uid", uid)
        step = _Keyed(uid, fn, inputs)
        flow._add_step(step)
        for sink in outputs:
            flow._add_sink(sink)
            step.taps.append(Tap(sink.name, (), side=True))
        return Stream(flow, (_Strand(step),))

    def window(self, aggregation: KeyedProcessFunction, *, uid: str | None = None) -> Stream:
        """A windowed aggregation (``microbatch.windows.tumbling(...)...final()``) as a
        keyed step; its output rows: ``key``, ``window_start``, ``window_end`` and one
        column per aggregate."""
        if not getattr(aggregation, "columnar", False):
            raise ConfigError(
                f"dataflow {self._stream._flow.name!r}: window() takes a windowed "
                "aggregation, such as windows.tumbling('1m').count().final()"
            )
        return self.process(aggregation, uid=uid)
