"""The user's keyed function and the context it sees.

Subclass :class:`KeyedProcessFunction`::

    class CountClicks(KeyedProcessFunction):
        def process(self, key, records, ctx):
            count = ctx.value("count")
            count.set(count.get(0) + len(records))
            ctx.emit({"user": key, "clicks": count.get()})

``process`` is called once per key per batch with that key's records of the batch, in a
deterministic order (source topic, partition, offset). ``on_timer`` is called for each
event-time timer the batch's watermark passes, in timestamp order, then for each
processing-time timer the batch's recorded processing time passes (``ctx.time_domain``
says which; the processing time is the plan's, so a rerun fires the same timers). Both
may read and write the key's state, register timers and emit records. Every operator
instance runs every batch, even without input, so timers fire on time.
"""

from __future__ import annotations

import builtins  # in ProcessContext's body, `list` is its method
import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from microbatch.state.handles import (
    BatchState,
    KeyContext,
    KeyedMaps,
    KeyedValues,
    ListState,
    MapState,
    ValueState,
)

if TYPE_CHECKING:
    import pyarrow as pa

    from microbatch.runtime.side_columns import SideColumns


class ProcessContext:
    """State, timers and output of the current key (valid during one call only)."""

    def __init__(
        self,
        key_ctx: KeyContext,
        watermark: int | None,
        processing_time_ms: int,
        time_domain: str = "event_time",
        watermark_before: int | None = None,
    ) -> None:
        self._key_ctx = key_ctx
        self.watermark = watermark
        #: The watermark the batch started with: records behind it may be late (a function
        #: with ``late_records`` judges them itself, as the joins do).
        self.watermark_before = watermark_before
        self.processing_time_ms = processing_time_ms
        #: In ``on_timer``: ``"event_time"`` or ``"processing_time"``, the timer's kind.
        self.time_domain = time_domain
        self.emitted: list[tuple[str | None, Any]] = []
        #: ``(reason, error, record)`` of records this call dead-lettered.
        self.dead: list[tuple[str, str, Any]] = []

    @property
    def key(self) -> Any:
        return self._key_ctx.key

    @property
    def key_state(self) -> KeyContext:
        """The key's state in this batch's operator instance: ``key_state.backend`` is the
        same object for every call of one instance in one batch (and a new one on a rerun),
        so an operator can keep data that lives exactly as long as the batch's state."""
        return self._key_ctx

    def value(self, name: str, ttl: float | None = None) -> ValueState:
        return self._key_ctx.value(name, ttl)

    def list(self, name: str, ttl: float | None = None) -> ListState:
        return self._key_ctx.list(name, ttl)

    def map(self, name: str, ttl: float | None = None) -> MapState:
        return self._key_ctx.map(name, ttl)

    def register_timer(self, timestamp_ms: int) -> None:
        """Call ``on_timer`` for this key once the watermark reaches ``timestamp_ms``."""
        self._key_ctx.register_timer(int(timestamp_ms))

    def delete_timer(self, timestamp_ms: int) -> None:
        self._key_ctx.delete_timer(int(timestamp_ms))

    def timers(self) -> builtins.list[int]:
        return self._key_ctx.timers()

    def register_processing_timer(self, timestamp_ms: int) -> None:
        """Call ``on_timer`` for this key in the first batch whose processing time (when
        it was planned; ``ctx.processing_time_ms``) reaches ``timestamp_ms``."""
        self._key_ctx.register_processing_timer(int(timestamp_ms))

    def delete_processing_timer(self, timestamp_ms: int) -> None:
        self._key_ctx.delete_processing_timer(int(timestamp_ms))

    def processing_timers(self) -> builtins.list[int]:
        return self._key_ctx.processing_timers()

    def emit(self, record: Any, sink: str | None = None, *, to: str | None = None) -> None:
        """Send ``record`` on: to the step's main output (its sinks and the next keyed
        step; in a single-operator pipeline, every user sink), or with ``to`` (or
        ``sink``) only to that sink of the step — a side output."""
        self.emitted.append((to or sink, record))

    def dead_letter(self, reason: str, error: str, record: Any = None) -> None:
        """Send ``record`` to the pipeline's dead letters with ``reason`` (a short word,
        such as ``late_join``) and ``error`` (what happened, for a person), instead of
        processing it; counted in the batch's ``dead_letters.<reason>``."""
        self.dead.append((reason, error, record))


class Sided(NamedTuple):
    """A record of a keyed step with several inputs (a join): ``side`` is the input's
    place (0: the stream the step was called on, 1: the first other one, ...)."""

    side: int
    record: Any


@dataclasses.dataclass(frozen=True)
class KeyedBatch:
    """One operator instance's records of a batch, every key at once, for
    :meth:`KeyedProcessFunction.process_batch`: key ``k`` (in processing order) has the
    records ``records[bounds[k]:bounds[k + 1]]``."""

    #: Every record in processing order (key by key), without ``Sided`` wrappers.
    records: Sequence[Any]
    #: ``len(keys) + 1`` positions into ``records``.
    bounds: np.ndarray
    #: The input of each record (a join's: 0 left, 1 right); None for one input.
    sides: np.ndarray | None
    #: Per key: does it hold event-time timers? Such a key has state waiting on them.
    timed: np.ndarray
    #: The batch's watermark and the one it started with (``ctx.watermark`` and
    #: ``ctx.watermark_before`` of its calls).
    watermark: int | None
    watermark_before: int | None
    #: The state and timers of the batch's keys (see :meth:`value`, :meth:`map`).
    state: BatchState | None = None
    #: A join's records as columns per side, for a function that reads them
    #: (:mod:`~microbatch.runtime.side_columns`); None: records only.
    columns: SideColumns | None = None

    @classmethod
    def on_backend(
        cls, backend: Any, key_groups: Sequence[int], key_bytes: Sequence[bytes],
        records: Sequence[Any], bounds: np.ndarray, sides: np.ndarray | None,
        watermark: int | None, watermark_before: int | None,
        columns: SideColumns | None = None,
    ) -> KeyedBatch:  # fmt: skip
        """The batch of keys ``key_bytes`` (in ``key_groups``) held in ``backend`` (a
        ``KeyedStateBackend`` with their state loaded): which have timers, and their
        value states — as stage 2 and the test harness both build it."""
        waiting = backend.timers.keys()
        timed = np.zeros(len(key_bytes), dtype=bool)
        if waiting:
            timed[:] = [kb in waiting for kb in key_bytes]
        state = BatchState(backend, key_groups, key_bytes)
        return cls(records, bounds, sides, timed, watermark, watermark_before, state, columns)

    @property
    def key_count(self) -> int:
        return len(self.bounds) - 1

    def key_of(self) -> np.ndarray:
        """Each record's key, as its place ``k`` in the batch."""
        return np.repeat(np.arange(self.key_count), np.diff(self.bounds))

    def value(self, name: str, ttl: float | None = None) -> KeyedValues:
        """Value state ``name`` of the batch's keys, by their place: what ``ctx.value``
        gives each key's call."""
        return self._state().value(name, ttl)

    def map(self, name: str, ttl: float | None = None) -> KeyedMaps:
        """Map state ``name`` of the batch's keys, by their place: what ``ctx.map``
        gives each key's call."""
        return self._state().map(name, ttl)

    def register_timers(self, keys: Sequence[int], timestamps: Sequence[int]) -> None:
        """An event-time timer at ``timestamps[i]`` for key ``keys[i]``: what
        ``ctx.register_timer`` does in that key's call."""
        self._state().register_timers(keys, timestamps)

    def delete_timers(self, keys: Sequence[int], timestamps: Sequence[int]) -> None:
        """Key ``keys[i]``'s event-time timer at ``timestamps[i]`` deleted: what
        ``ctx.delete_timer`` does in that key's call."""
        self._state().delete_timers(keys, timestamps)

    def _state(self) -> BatchState:
        if self.state is None:
            raise NotImplementedError("this runtime gives process_batch no state")
        return self.state


@dataclasses.dataclass(frozen=True)
class Handled:
    """What :meth:`KeyedProcessFunction.process_batch` did: ``keys[k]`` is true for each
    key it processed; ``emitted[k]``, that key's main-output records (absent: none).
    Output as columns instead: ``columns``, a table whose row ``i`` is key
    ``column_keys[i]``'s, in key order; it goes on before the output of the keys left to
    ``process``."""

    keys: np.ndarray
    emitted: dict[int, builtins.list[Any]]
    columns: pa.Table | None = None
    column_keys: np.ndarray | None = None


def has_batch_hook(fn: KeyedProcessFunction) -> bool:
    """Does ``fn`` override :meth:`KeyedProcessFunction.process_batch`?"""
    return type(fn).process_batch is not KeyedProcessFunction.process_batch


class KeyedProcessFunction:
    """Base class of keyed processing; override ``process`` and maybe ``on_timer``."""

    #: True: the function also gets records behind the watermark and decides about them
    #: itself (the joins do: a late record may still match). False: stage 1 makes them
    #: dead letters ``late`` (as windows decide for themselves, they never get there).
    late_records: bool = False

    def process(self, key: Any, records: Sequence[Any], ctx: ProcessContext) -> None:
        raise NotImplementedError(f"{type(self).__name__} must implement process()")

    def process_batch(self, batch: KeyedBatch) -> Handled | None:
        """Optional: process keys at once — cheaper than a call per key when keys are
        many and each does little (a window join's windows that close in their own
        batch, a table join's updates). Called once per instance before any ``process``
        call; the keys it leaves get their ``process`` call as usual, and each key's
        output takes its place in key order. For the keys it takes it must leave the
        state, timers and output ``process`` and the batch's timers would, and only do
        what this allows: read and write value and map state (``batch.value(name)``,
        ``batch.map(name)``), register and delete event-time timers
        (``batch.register_timers``, ``batch.delete_timers``: a timer the batch's
        watermark would fire for nothing), emit to the main output. A key that would
        dead-letter a record or raise is left to ``process``. Default: none."""
        return None

    def on_timer(self, key: Any, timestamp_ms: int, ctx: ProcessContext) -> None:
        """Called when a timer of ``key`` fires (``ctx.time_domain``: which kind); default:
        nothing."""
