"""Tombstones: a compacted or changelog topic's deletes (a Kafka key with a null value).

A source opts in with ``KafkaSource(tombstones=True)``; each tombstone then reaches the
pipeline as a ``None`` record keyed by its Kafka key (``KafkaSource.key_of_tombstone``),
not by ``key_by`` — which cannot read a key out of ``None``. Everything else about the
record is absent: no value to run stateless steps on, no event time, no field to key by.

So a tombstone goes only where ``None`` means "delete this key": an input of a keyed step
whose function lists that input in ``tombstone_sides`` (the table side of a
:class:`~microbatch.joins.TableJoin`), straight from the source, with no stateless step
or sink before it. :func:`check_tombstones` refuses any other use when the pipeline is
built, naming the source and the step. Such a step always has two inputs, so its records
travel as payloads (:func:`~microbatch.runtime.column_plan.columnar_values` is None): the
columnar stage-1 path never meets a source with tombstones and keeps dead-lettering
null values as ``undecodable``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from microbatch.errors import ConfigError
from microbatch.runtime.graph import edges_from, step_order

if TYPE_CHECKING:
    from microbatch.runtime.pipeline import KafkaSource, Pipeline

_HOW = (
    "A tombstone (a null value) has no fields, so it can only delete the key of a table: "
    "read the changelog as the right side of a TableJoin, keyed straight from its source "
    "(stream.key_by(...).join(changelog.key_by(...), TableJoin(...))); or leave "
    "tombstones=False, and null values are dead letters 'undecodable'."
)


def sources_of(pipeline: Pipeline) -> tuple[KafkaSource, ...]:
    """The pipeline's sources, by index (one unless it reads several)."""
    return tuple(i.source for i in pipeline.inputs) or (pipeline.source,)


def check_tombstones(pipeline: Pipeline, where: str) -> None:
    """Refuse a source with ``tombstones=True`` whose records could reach anything but an
    input declared in its step function's ``tombstone_sides``."""
    functions = dict(
        zip(step_order(pipeline), (pipeline.process, *(s.process for s in pipeline.steps)),
            strict=True)
    )  # fmt: skip
    for index, source in enumerate(sources_of(pipeline)):
        if not source.tombstones:
            continue
        what = f"{where}: the source of {list(source.topics)} has tombstones=True"
        if not pipeline.edges:
            raise ConfigError(f"{what}, but its records go to no join. {_HOW}")
        if pipeline.enrich is not None:
            raise ConfigError(f"{what}, and enrichment would get None records. {_HOW}")
        taps = [t.sink for t in pipeline.source_taps if t.source in (None, index)]
        if taps:
            raise ConfigError(f"{what}, and it feeds sink {taps[0]!r} directly. {_HOW}")
        for edge in edges_from(pipeline, index):
            fn = functions[edge.target]
            step = f"step {edge.target!r} ({type(fn).__name__})"
            if edge.side not in getattr(fn, "tombstone_sides", ()):
                raise ConfigError(
                    f"{what}, and it feeds input {edge.side} of {step}, which does not take "
                    f"None records as deletes. {_HOW}"
                )
            if edge.chain:
                names = ", ".join(s.name for s in edge.chain)
                raise ConfigError(
                    f"{what}, and its records go through stateless steps ({names}) before "
                    f"{step}, which would get None. {_HOW}"
                )
