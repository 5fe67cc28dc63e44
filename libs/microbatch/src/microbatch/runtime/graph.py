"""A pipeline's keyed steps as a graph: which records reach each step, keyed how.

An :class:`Edge` takes the records of its *origin* — a source (its index among the
pipeline's inputs) or a keyed step's main output (its uid) — through stateless steps,
keys them by its own ``key_by`` and hands them to keyed step ``target`` as input
``side`` (0 unless the target joins several inputs: see
:class:`~microbatch.runtime.process.Sided`). A chain of steps is the graph whose edges
each go from one step to the next; a dataflow that branches, unions after a keyed step,
feeds a later step from a source, or joins, sets the pipeline's ``edges`` itself.

The keyed steps run in the pipeline's order (the first, then ``steps``), one exchange
each; a step's origins come before it. Rows for a later step ride through the exchanges
between, so one Spark job still runs the whole graph. A row says whom it is for in its
``topic``: a source's records for the first step carry their topic, every other row
``<tag>>``\\ ``<target uid>``, where the tag is the source topic or ``@<origin uid>``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from microbatch.errors import ConfigError
from microbatch.runtime.steps import FOR, Chain

if TYPE_CHECKING:
    from microbatch.runtime.pipeline import Pipeline

Key = str | Callable[[Any], Any]
__all__ = ["FOR", "Edge", "check_edges", "edges_from", "edges_into", "edges_of", "marker"]


@dataclasses.dataclass(frozen=True)
class Edge:
    """Records of ``origin`` (a source's index, or a keyed step's uid) into keyed step
    ``target``: through ``chain``, keyed by ``key_by``, as the target's input ``side``."""

    origin: int | str
    target: str
    key_by: Key
    chain: Chain = ()
    side: int = 0

    def key_of(self, record: Any) -> Any:
        if callable(self.key_by):
            return self.key_by(record)
        return record.get(self.key_by) if isinstance(record, Mapping) else None


def first_uid(pipeline: Pipeline) -> str:
    return pipeline.uid or ""


def step_order(pipeline: Pipeline) -> tuple[str, ...]:
    """The keyed steps' uids in the order they run."""
    return (first_uid(pipeline), *(s.uid for s in pipeline.steps))


def edges_of(pipeline: Pipeline) -> tuple[Edge, ...]:
    """Every edge of the pipeline: its own ``edges``, or those of its chain."""
    if pipeline.edges:
        return tuple(pipeline.edges)
    first = first_uid(pipeline)
    key = pipeline.key_by
    if key is None:  # a dataflow without keyed steps: only sinks (``steps.sink_only``)
        return ()
    if pipeline.inputs:
        edges = [Edge(i, first, key, inp.prefix) for i, inp in enumerate(pipeline.inputs)]
    else:
        edges = [Edge(0, first, key, tuple(pipeline.prefix))]
    before = first
    for step in pipeline.steps:
        edges.append(Edge(before, step.uid, step.key_by, step.before))
        before = step.uid
    return tuple(edges)


def edges_from(pipeline: Pipeline, origin: int | str) -> tuple[Edge, ...]:
    return tuple(e for e in edges_of(pipeline) if e.origin == origin)


def edges_into(pipeline: Pipeline, target: str) -> tuple[Edge, ...]:
    return tuple(e for e in edges_of(pipeline) if e.target == target)


def source_topics(pipeline: Pipeline, index: int) -> tuple[str, ...]:
    if pipeline.inputs:
        return tuple(pipeline.inputs[index].source.topics)
    return tuple(pipeline.source.topics)


def source_of_topic(pipeline: Pipeline) -> dict[str, int]:
    """Each topic's source index."""
    count = len(pipeline.inputs) or 1
    return {t: i for i in range(count) for t in source_topics(pipeline, i)}


def marker(origin: int | str, target: str, topic: str | None = None) -> str:
    """The ``topic`` of a row of ``origin`` for ``target`` (a source's: ``topic``'s)."""
    tag = topic if isinstance(origin, int) else f"@{origin}"
    return f"{tag}{FOR}{target}"


def sides(pipeline: Pipeline, target: str) -> dict[str, int] | None:
    """The input side of each row tag (a topic, or ``@<uid>``) reaching ``target``; None
    when the step has one input (its records are not :class:`Sided`)."""
    into = edges_into(pipeline, target)
    if all(e.side == 0 for e in into):
        return None
    out: dict[str, int] = {}
    for e in into:
        if isinstance(e.origin, int):
            out |= {t: e.side for t in source_topics(pipeline, e.origin)}
        else:
            out[f"@{e.origin}"] = e.side
    return out


def check_edges(pipeline: Pipeline, where: str) -> None:
    """Refuse a graph that cannot run, naming the step: an edge from a step that does not
    run before its target, into a step that is not the pipeline's, from an unknown
    source, one origin feeding a step twice, a first step fed by a step, a later step
    fed by nothing, a window with several inputs, or sides that are not 0..n-1."""
    if not pipeline.edges:
        return
    order = step_order(pipeline)
    place = {uid: i for i, uid in enumerate(order)}
    count = len(pipeline.inputs) or 1
    seen: set[tuple[int | str, str]] = set()
    for e in pipeline.edges:
        if e.target not in place:
            raise ConfigError(f"{where}: an edge goes into {e.target!r}, which is no keyed step")
        if isinstance(e.origin, int):
            if not 0 <= e.origin < count:
                raise ConfigError(f"{where}: step {e.target!r} reads source {e.origin}, of {count}")
        elif e.origin not in place or place[e.origin] >= place[e.target]:
            raise ConfigError(
                f"{where}: step {e.target!r} reads step {e.origin!r}, which does not run "
                f"before it (order: {', '.join(map(repr, order))})"
            )
        if (e.origin, e.target) in seen:
            raise ConfigError(f"{where}: step {e.target!r} reads {e.origin!r} twice")
        seen.add((e.origin, e.target))
    for uid in order:
        into = edges_into(pipeline, uid)
        if not into:
            raise ConfigError(f"{where}: keyed step {uid!r} reads nothing")
        if uid == order[0] and any(not isinstance(e.origin, int) for e in into):
            raise ConfigError(f"{where}: the first keyed step {uid!r} reads only sources")
        found = sorted({e.side for e in into})
        if found != list(range(len(found))):
            raise ConfigError(f"{where}: step {uid!r} has input sides {found}, not 0..n-1")
    functions = (pipeline.process, *(s.process for s in pipeline.steps))
    windowed = [
        uid
        for uid, fn in zip(order, functions, strict=True)
        if getattr(fn, "columnar", False) and sides(pipeline, uid) is not None
    ]
    if windowed:
        raise ConfigError(f"{where}: window step {windowed[0]!r} takes one input, not a join")
