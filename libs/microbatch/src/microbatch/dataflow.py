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
steps with one uid, a window without event time, two keyed steps reading one step's
output (not supported yet).
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from microbatch.errors import ConfigError
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
from microbatch.runtime.steps import Chain, KeyedStep, Stateless, Tap
from microbatch.sinks import Sink
from microbatch.validation import check_name

__all__ = ["Dataflow", "KeyedStream", "MissingUidWarning", "Stream"]

Key = str | Callable[[Any], Any]


class MissingUidWarning(UserWarning):
    """A keyed step without ``uid=``: its state is named after its position, so inserting
    a keyed step before it later would hand it another step's state."""


@dataclasses.dataclass
class _Keyed:
    """A keyed step while the dataflow is being written."""

    uid: str
    key_by: Key
    process: KeyedProcessFunction
    before: Chain
    parent: _Keyed | None  # None: the sources
    taps: list[Tap] = dataclasses.field(default_factory=list)
    #: The first keyed step: each source's stateless steps before it (by source index).
    inputs: dict[int, Chain] = dataclasses.field(default_factory=dict)


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
        return Stream(self, None, (), {len(self._sources) - 1: ()})

    def build(self) -> Pipeline:
        """The pipeline this dataflow is: checked, ready for the runner."""
        where = f"dataflow {self.name!r}"
        if not self._sources:
            raise ConfigError(f"{where}: no source; start with flow.source(KafkaSource(...))")
        first, *rest = self._spine(where)
        unread = [s for i, s in enumerate(self._sources) if i not in first.inputs]
        if unread:
            topics = ", ".join(t for s in unread for t in s.topics)
            raise ConfigError(
                f"{where}: the source of {topics} feeds no keyed step; union() it into the "
                f"stream of the first keyed step {first.uid!r} (a source feeding a later "
                "step is not supported yet)"
            )
        if len(self._sources) == 1:
            source, prefix, inputs = self._sources[0], first.inputs[0], ()
        else:
            source = combined_source(self._sources, where)
            prefix = ()
            inputs = tuple(Input(s, first.inputs[i]) for i, s in enumerate(self._sources))
        return Pipeline(
            name=self.name,
            source=source,
            inputs=inputs,
            enrich=self._enrich,
            key_by=first.key_by,
            process=first.process,
            prefix=prefix,
            source_taps=tuple(self._source_taps),
            uid=first.uid,
            taps=tuple(first.taps),
            steps=tuple(
                KeyedStep(s.uid, s.key_by, s.process, s.before, tuple(s.taps)) for s in rest
            ),
            sinks=tuple(self._sinks),
            **self._settings,
        )

    def _spine(self, where: str) -> list[_Keyed]:
        """The keyed steps as one chain, first to last."""
        if not self._steps:
            raise ConfigError(
                f"{where}: no keyed step; add .key_by(...).process(...) or .window(...)"
            )
        children: dict[int | None, list[_Keyed]] = {}
        for step in self._steps:
            children.setdefault(None if step.parent is None else id(step.parent), []).append(step)
        spine: list[_Keyed] = []
        at: int | None = None
        while True:
            after = children.get(at, [])
            if len(after) > 1:
                what = "the source" if at is None else f"step {spine[-1].uid!r}"
                raise ConfigError(
                    f"{where}: steps {', '.join(repr(s.uid) for s in after)} all read {what}; "
                    "two keyed steps reading one stream is not supported yet: chain them"
                )
            if not after:
                break
            spine.append(after[0])
            at = id(after[0])
        return spine

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


class Stream:
    """Records flowing out of the source or of a keyed step, after stateless steps."""

    def __init__(
        self,
        flow: Dataflow,
        origin: _Keyed | None,
        chain: Chain,
        inputs: dict[int, Chain] | None = None,
    ) -> None:
        self._flow = flow
        self._origin = origin
        self._chain = chain
        #: Before the first keyed step: each source's steps so far, by source index.
        self._inputs = inputs or {}

    def _then(self, kind: str, fn: Callable[[Any], Any], name: str | None) -> Stream:
        n = max([len(self._chain), *map(len, self._inputs.values())]) + 1
        after = "source" if self._origin is None else self._origin.uid
        step = Stateless(kind, fn, name or f"{after}.{kind}-{n}")  # type: ignore[arg-type]
        inputs = {i: (*chain, step) for i, chain in self._inputs.items()}
        return Stream(self._flow, self._origin, (*self._chain, step), inputs)

    def union(self, *others: Stream) -> Stream:
        """One stream of this one's records and ``others``': sources (each after its own
        stateless steps) merged before the first keyed step."""
        inputs = dict(self._inputs)
        for other in (self, *others):
            if other._flow is not self._flow or other._origin is not None:
                raise ConfigError(
                    f"dataflow {self._flow.name!r}: union() merges streams of this "
                    "dataflow's sources before their first keyed step (a union after a "
                    "keyed step is not supported yet)"
                )
        for other in others:
            for i, chain in other._inputs.items():
                if i in inputs:
                    raise ConfigError(
                        f"dataflow {self._flow.name!r}: the source of "
                        f"{list(self._flow._sources[i].topics)} is in the union twice"
                    )
                inputs[i] = chain
        return Stream(self._flow, None, (), inputs)

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
        fresh = self._origin is None and not any(self._inputs.values())
        if not fresh or flow._enrich is not None or len(self._inputs) != 1:
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
        if self._origin is None:
            if len(self._inputs) != 1 or len(flow._sources) != 1:
                raise ConfigError(
                    f"dataflow {flow.name!r}: a sink before the first keyed step needs a "
                    f"dataflow of one source (sink {sink.name!r}); not supported yet with "
                    "several"
                )
            flow._add_sink(sink)
            flow._source_taps.append(Tap(sink.name, next(iter(self._inputs.values()))))
        else:
            flow._add_sink(sink)
            self._origin.taps.append(Tap(sink.name, self._chain))
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
        flow = self._stream._flow
        if not isinstance(fn, KeyedProcessFunction):
            raise ConfigError(
                f"dataflow {flow.name!r}: process() takes a KeyedProcessFunction instance, "
                f"got {fn!r}"
            )
        if uid is None:
            uid = flow._default_uid(fn)
        check_name("step uid", uid)
        stream = self._stream
        step = _Keyed(uid, self._key, fn, stream._chain, stream._origin, inputs=stream._inputs)
        flow._add_step(step)
        for sink in outputs:
            flow._add_sink(sink)
            step.taps.append(Tap(sink.name, (), side=True))
        return Stream(flow, step, ())

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
