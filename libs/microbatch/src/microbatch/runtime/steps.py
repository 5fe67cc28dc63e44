"""The steps of a dataflow as the runtime runs them (the fluent API in
:mod:`microbatch.dataflow` builds them).

A pipeline is a spine of keyed steps, each after an exchange by key-group:

- the *prefix*: stateless steps (:class:`Stateless`: map, filter, flat_map) between the
  source and the first key, run in stage 1 right after decoding;
- the *first keyed step*: the pipeline's ``key_by`` and ``process``, whose state is the
  checkpoint's own (a single-operator pipeline is exactly this step);
- further :class:`KeyedStep` s, each with the stateless steps from the output of the step
  before to its key, its own ``key_by``, ``process`` and state (by ``uid``).

Each keyed step's output goes to its :class:`Tap` s (sinks, through their own stateless
steps) and to the next keyed step. Records emitted with ``ctx.emit(record, to=name)`` go
to sink ``name`` of that step only (a side output).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Literal

from microbatch.errors import ConfigError, MicrobatchError, error_text
from microbatch.runtime.columns import ColumnStep
from microbatch.runtime.process import KeyedProcessFunction

StatelessKind = Literal["map", "filter", "flat_map"]
#: In an envelope row's ``topic``: what comes before the uid of the keyed step the row is
#: for, when that is not the first step (see :mod:`microbatch.runtime.graph`); a topic
#: and a uid never hold it.
FOR = ">"
_KINDS = ("map", "filter", "flat_map")


class StepFailed(MicrobatchError):
    """A stateless step's function raised (or a flat_map returned no iterable): the
    record becomes a dead letter ``step_failed`` or fails the batch, as the pipeline's
    ``on_process_error`` says."""

    def __init__(self, step: str, error: str) -> None:
        super().__init__(f"step {step!r} raised {error}")
        self.step = step
        self.error = error


@dataclasses.dataclass(frozen=True)
class Stateless:
    """One stateless step: ``map`` (a record → a record), ``filter`` (keep when true) or
    ``flat_map`` (a record → an iterable of records). ``name``: how errors name it."""

    kind: StatelessKind
    fn: Callable[[Any], Any]
    name: str

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise ConfigError(f"stateless step {self.name!r}: kind must be one of {_KINDS}")
        if not callable(self.fn):
            raise ConfigError(f"{self.kind} step {self.name!r} needs a function: {self.fn!r}")


Chain = tuple[Stateless, ...]


def filters_only(chain: Sequence[Stateless]) -> bool:
    """Does ``chain`` only drop records (never change one)? Then a record that passes
    still is its source bytes, and stage 1 hands those on instead of re-encoding it."""
    return all(step.kind == "filter" for step in chain)


def run_chain(chain: Sequence[Stateless], record: Any) -> list[Any]:
    """The records ``record`` becomes after ``chain`` (none, one or several), in order;
    raises :class:`StepFailed` naming the step whose function raised."""
    records = [record]
    for step in chain:
        out: list[Any] = []
        for r in records:
            try:
                if step.kind == "map":
                    out.append(step.fn(r))
                elif step.kind == "filter":
                    if step.fn(r):
                        out.append(r)
                else:
                    produced = step.fn(r)
                    if produced is None or isinstance(produced, str | bytes | Mapping):
                        raise TypeError(
                            f"flat_map must return an iterable of records, got "
                            f"{type(produced).__name__}"
                        )
                    out.extend(produced)
            except Exception as e:  # user code: the caller decides dead letter or failure
                raise StepFailed(step.name, error_text(e)) from e
        records = out
        if not records:
            break
    return records


@dataclasses.dataclass(frozen=True)
class Tap:
    """Records of a keyed step that go to sink ``sink``: its main output through
    ``chain``, or (``side``) only what it emits with ``ctx.emit(record, to=sink)``."""

    sink: str
    chain: Chain = ()
    side: bool = False
    #: A tap before the first keyed step in a pipeline of several sources: which one's
    #: records it takes (its index among the pipeline's inputs; None: every record).
    source: int | None = None
    #: A tap before the first keyed step: column steps (``where``/``select``) on the
    #: source's declared columns, before ``chain``.
    columns: tuple[ColumnStep, ...] = ()


class NoKeyedStep(KeyedProcessFunction):
    """The first keyed step of a dataflow that has none — source → steps → sinks: it is
    given no record (stage 1 sends the records to the sinks only), keeps no state, and
    lets the runtime run such a dataflow as a pipeline whose only outputs are taps."""

    def process(self, key: Any, records: Any, ctx: Any) -> None:
        raise MicrobatchError("a dataflow without keyed steps got a keyed record (a bug)")


def sink_only(pipeline: Any) -> bool:
    """Is ``pipeline`` a dataflow without keyed steps (its sinks fed by the sources)?"""
    return isinstance(getattr(pipeline, "process", None), NoKeyedStep)


@dataclasses.dataclass(frozen=True)
class KeyedStep:
    """A keyed step after the first: ``before`` runs on each output record of the step
    before it, then the records are keyed by ``key_by``, exchanged by key-group, and
    ``process`` runs per key with its own state, named ``uid`` in the checkpoint."""

    uid: str
    key_by: str | Callable[[Any], Any]
    process: KeyedProcessFunction
    before: Chain = ()
    taps: tuple[Tap, ...] = ()

    def key_of(self, record: Any) -> Any:
        if callable(self.key_by):
            return self.key_by(record)
        return record.get(self.key_by) if isinstance(record, Mapping) else None

    def sinks(self) -> tuple[str, ...]:
        return tuple(t.sink for t in self.taps)


def check_steps(
    where: str,
    first_uid: str | None,
    first_taps: Sequence[Tap] | None,
    steps: Sequence[KeyedStep],
    sink_names: Iterable[str],
    has_event_time: bool,
    source_taps: Sequence[Tap] = (),
) -> None:
    """Refuse a spine that cannot work, naming the step: two steps with one uid, a sink
    fed by two steps or by none, a tap naming no sink, a window without event time."""
    names = list(sink_names)
    uids = [first_uid or "", *(s.uid for s in steps)]
    seen: set[str] = set()
    for uid in uids:
        if uid in seen:
            raise ConfigError(f"{where}: two keyed steps have the uid {uid!r}; uids must differ")
        seen.add(uid)
    if first_taps is None:
        if steps or source_taps:
            raise ConfigError(f"{where}: a pipeline with several steps needs taps")
        return
    fed: dict[str, str] = {}
    spine = [(first_uid or "", first_taps), *((s.uid, s.taps) for s in steps)]
    for uid, taps in [("source", tuple(source_taps)), *spine]:
        for tap in taps:
            if tap.sink not in names:
                raise ConfigError(
                    f"{where}: step {uid!r} sends records to sink {tap.sink!r}, which is not "
                    f"one of the pipeline's sinks ({', '.join(names) or 'none'})"
                )
            if tap.sink in fed:
                raise ConfigError(
                    f"{where}: sink {tap.sink!r} is fed by steps {fed[tap.sink]!r} and {uid!r}; "
                    "a sink belongs to one step (give each its own sink)"
                )
            fed[tap.sink] = uid
    unfed = [n for n in names if n not in fed]
    if unfed:
        raise ConfigError(f"{where}: no step sends records to sink(s) {', '.join(unfed)}")
    for step in steps:
        if getattr(step.process, "columnar", False) and not has_event_time:
            raise ConfigError(
                f"{where}: step {step.uid!r} is a window, and windows need event time: set "
                "event_time=EventTime(field=...)"
            )
        if not isinstance(step.process, KeyedProcessFunction):
            raise ConfigError(
                f"{where}: step {step.uid!r} needs a KeyedProcessFunction instance, got "
                f"{step.process!r}"
            )
