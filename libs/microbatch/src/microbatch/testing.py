"""Test your process function without Spark.

:class:`ProcessHarness` runs a :class:`~microbatch.runtime.process.KeyedProcessFunction`
batch by batch on the in-memory state backend, the way stage 2 of a batch runs it
(:mod:`microbatch.runtime.stage_two`), per operator instance:

1. ``process_batch`` (when the function has one) over the instance's keys at once — a
   join's sides also as columns when the function reads them and a side's records are
   alike, as stage 2 gives them; rows it emits as columns come first — then
   ``process(key, records, ctx)`` once for each key with records in the batch that it
   left, keys in the order of their canonical bytes, each key's records in the order
   given (the source order); ``BatchResult.keys_batched`` counts the keys it took;
2. ``on_timer`` for each event-time timer the batch's watermark reaches, in timestamp
   order (a timer registered meanwhile that is already due fires in the same batch), then
   for each processing-time timer the batch's processing time reaches;
3. expired TTL entries are dropped and the state goes through a checkpoint's row form
   (``export_rows``, then ``import_rows`` into a fresh backend for the next batch), so a
   function that keeps what a checkpoint cannot hold fails here as it would in production.

::

    harness = ProcessHarness(CountClicks())
    result = harness.batch([("u1", {"page": "a"}), ("u1", {"page": "b"})])
    assert result.emitted == ({"user": "u1", "clicks": 2},)

A join's records carry their input: tag each input's ``(key, record)`` pairs with
:func:`sided`, ``harness.batch(sided(bids, auctions), watermark=...)``.

What the harness does not do: stage 1. Records are handed over as given — not decoded,
not keyed by ``key_by``, never dead-lettered as ``late`` or ``missing_event_time`` — and
the watermark is the test's to give.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import pyarrow as pa

from microbatch.keygroups import (
    Key,
    check_parallelism,
    decode_key,
    encode_key,
    key_group_of_bytes,
    key_group_range,
    operator_index,
)
from microbatch.runtime.process import (
    Handled,
    KeyedBatch,
    KeyedProcessFunction,
    ProcessContext,
    Sided,
    has_batch_hook,
)
from microbatch.runtime.side_columns import SideColumns
from microbatch.state.backend import KeyedStateBackend, Rows
from microbatch.state.codec import CodecError, encode_values
from microbatch.state.handles import KeyContext

Records = Mapping[Key, Sequence[Any]] | Iterable[tuple[Key, Any]]


@dataclasses.dataclass(frozen=True)
class DeadLetter:
    """What the function sent with ``ctx.dead_letter`` (and for which key)."""

    reason: str
    error: str
    record: Any
    key: Any


@dataclasses.dataclass(frozen=True)
class BatchResult:
    """The output of one batch, in the order the runtime produces it (instance by
    instance: ``process`` calls in key order, then timers)."""

    #: Records sent to the main output (``ctx.emit(record)``).
    emitted: tuple[Any, ...]
    #: Records sent to a named sink (``ctx.emit(record, to=name)``), per name.
    side_outputs: Mapping[str, tuple[Any, ...]]
    dead_letters: tuple[DeadLetter, ...]
    #: The batch's watermark (what ``ctx.watermark`` was; timers fired up to it).
    watermark: int | None
    timers_fired: int
    #: Keys the function's ``process_batch`` processed (no ``process`` call of theirs).
    keys_batched: int = 0
    #: Of those, the keys whose output it gave as columns (a join on columns).
    keys_as_columns: int = 0


@dataclasses.dataclass(frozen=True)
class HarnessCheckpoint:
    """The state between two batches (its row form per key-group) and the clocks: what
    :meth:`ProcessHarness.restore` rewinds to, as a rerun of a failed batch would."""

    rows: Mapping[int, Rows]
    watermark: int | None
    processing_time_ms: int


def sided(*inputs: Iterable[tuple[Key, Any]]) -> list[tuple[Key, Sided]]:
    """The ``(key, record)`` pairs of a join's inputs as one batch: input ``i``'s records
    wrapped as ``Sided(i, record)``, input by input, each in its order — the order the
    runtime hands a join's records in."""
    return [(key, Sided(side, r)) for side, pairs in enumerate(inputs) for key, r in pairs]


class ProcessHarness:
    """Runs ``fn`` over batches with state, timers and checkpoints as the runtime does.

    ``max_parallelism``: the key-groups (as the pipeline's); ``parallelism``: how many
    operator instances share them (change it between batches with :meth:`rescale`).
    """

    def __init__(
        self, fn: KeyedProcessFunction, max_parallelism: int = 128, parallelism: int = 1
    ) -> None:
        check_parallelism(parallelism, max_parallelism)
        self.fn = fn
        self.max_parallelism = max_parallelism
        self.parallelism = parallelism
        self.watermark: int | None = None
        self.processing_time_ms = 0
        self._rows: dict[int, Rows] = {}

    # --- batches --------------------------------------------------------------------
    def batch(
        self,
        records: Records = (),
        *,
        watermark: int | None = None,
        processing_time_ms: int | None = None,
    ) -> BatchResult:
        """Run one batch. ``records``: ``{key: [record, ...]}`` or ``(key, record)`` pairs;
        ``watermark``: the batch's watermark in ms (never goes back; None keeps the last
        one); ``processing_time_ms``: the batch's processing time (None keeps the last
        one; it is also the state clock for TTL). A batch that raises changes nothing: the
        next one starts from the last checkpoint, as a rerun does."""
        before = self.watermark
        after = before if watermark is None else watermark
        if before is not None and after is not None and after < before:
            after = before  # watermarks never go back
        now = self.processing_time_ms if processing_time_ms is None else processing_time_ms
        by_key = _group(records, self.max_parallelism)
        emitted: list[Any] = []
        side: dict[str, list[Any]] = {}
        dead: list[DeadLetter] = []
        fired = batched = as_columns = 0
        rows: dict[int, Rows] = {}

        def collect(ctx: ProcessContext) -> None:
            for sink, record in ctx.emitted:
                (emitted if sink is None else side.setdefault(sink, [])).append(record)
            dead.extend(DeadLetter(r, e, rec, ctx.key) for r, e, rec in ctx.dead)

        def context(key_ctx: KeyContext, domain: str = "event_time") -> ProcessContext:
            ctx = ProcessContext(key_ctx, after, now, domain)
            ctx.watermark_before = before
            return ctx

        for instance in range(self.parallelism):
            backend = self._backend(instance, now)
            own = sorted(kb for kb in by_key if by_key[kb][1] in backend.key_groups)
            handled = self._process_batch(
                own, [by_key[kb][2] for kb in own], backend, before, after
            )
            if handled is not None and handled.columns is not None:
                emitted.extend(handled.columns.to_pylist())  # before the keys left to process
                as_columns += int(handled.keys.sum())
            for k, key_bytes in enumerate(own):
                key, _, records_of_key = by_key[key_bytes]
                if handled is not None and handled.keys[k]:
                    emitted.extend(handled.emitted.get(k, ()))
                    batched += 1
                    continue
                ctx = context(backend.for_key(key))
                self.fn.process(key, records_of_key, ctx)
                collect(ctx)

            def on_timer(key_ctx: KeyContext, ts: int, domain: str = "event_time") -> None:
                nonlocal fired
                fired += 1
                ctx = context(key_ctx, domain)
                self.fn.on_timer(key_ctx.key, ts, ctx)
                collect(ctx)

            if after is not None:
                backend.advance_watermark(after, on_timer)
            backend.advance_processing_time(
                now, lambda key_ctx, ts: on_timer(key_ctx, ts, "processing_time")
            )
            backend.prune_expired()
            rows.update((kg, backend.export_rows(kg)) for kg in backend.groups_with_state())
        self._rows = rows
        self.watermark, self.processing_time_ms = after, now
        return BatchResult(
            tuple(emitted),
            {name: tuple(recs) for name, recs in side.items()},
            tuple(dead),
            after,
            fired,
            batched,
            as_columns,
        )

    def _process_batch(
        self, own: list[bytes], by_key: list[Sequence[Any]], backend: KeyedStateBackend,
        before: int | None, after: int | None,
    ) -> Handled | None:  # fmt: skip
        """What the function's ``process_batch`` does with one instance's keys (``own``,
        in key order; ``by_key``: their records), as stage 2 calls it."""
        if not has_batch_hook(self.fn) or not by_key:
            return None
        records = [r for rs in by_key for r in rs]
        sided_ = all(isinstance(r, Sided) for r in records)
        plain = [r.record for r in records] if sided_ else records
        sides = np.array([r.side for r in records], np.int8) if sided_ else None
        batch = KeyedBatch.on_backend(
            backend, [key_group_of_bytes(kb, self.max_parallelism) for kb in own], own,
            plain, np.cumsum([0, *map(len, by_key)], dtype=np.int64), sides, after, before,
            self._columns(plain, sides),
        )  # fmt: skip
        return self.fn.process_batch(batch)

    def _columns(self, records: list[Any], sides: np.ndarray | None) -> SideColumns | None:
        """A join's records as stage 2 gives them to a function that reads columns: their
        payloads, read as a table per side where that side's records are alike."""
        if sides is None or not getattr(self.fn, "reads_columns", False):
            return None
        try:
            payloads = encode_values(records)
        except CodecError:  # no such record reaches stage 2: the function fails on it
            return None
        deletes = getattr(self.fn, "tombstone_sides", ())
        return SideColumns(pa.array(payloads, pa.binary()), sides, {}, deletes)

    def _backend(self, instance: int, now_ms: int) -> KeyedStateBackend:
        """A fresh backend of ``instance`` loaded from the last checkpoint's rows."""
        own = key_group_range(self.max_parallelism, self.parallelism, instance)
        backend = KeyedStateBackend(self.max_parallelism, own, clock=lambda: now_ms / 1000)
        for kg, rows in self._rows.items():
            if kg in own:
                backend.import_rows(kg, rows)
        return backend

    # --- checkpoints and rescaling --------------------------------------------------
    def rescale(self, parallelism: int) -> None:
        """Run the next batches with ``parallelism`` instances (state moves by key-group)."""
        self.parallelism = check_parallelism(parallelism, self.max_parallelism)

    def checkpoint(self) -> HarnessCheckpoint:
        return HarnessCheckpoint(dict(self._rows), self.watermark, self.processing_time_ms)

    def restore(self, checkpoint: HarnessCheckpoint) -> None:
        """Go back to ``checkpoint``: the next batch runs as a rerun would."""
        self._rows = dict(checkpoint.rows)
        self.watermark = checkpoint.watermark
        self.processing_time_ms = checkpoint.processing_time_ms

    # --- inspection -----------------------------------------------------------------
    def state(self, key: Key) -> dict[str, Any]:
        """Every live state of ``key`` as plain values, plus ``"timers"`` (and
        ``"processing_timers"``) when it has some; ``{}`` for a key with nothing."""
        kg = key_group_of_bytes(encode_key(key), self.max_parallelism)
        instance = operator_index(kg, self.max_parallelism, self.parallelism)
        return self._backend(instance, self.processing_time_ms).describe_key(key)

    def keys_with_state(self) -> list[Key]:
        """The keys that hold state or timers, in key-byte order (``[]``: state is clean)."""
        found: set[bytes] = set()
        for instance in range(self.parallelism):
            found |= self._backend(instance, self.processing_time_ms).keys()
        return [decode_key(kb) for kb in sorted(found)]


def _group(records: Records, max_parallelism: int) -> dict[bytes, tuple[Key, int, list[Any]]]:
    """``key bytes → (key, key-group, records)``, each key's records in the order given."""
    pairs: Iterable[tuple[Key, Any]]
    if isinstance(records, Mapping):
        pairs = ((k, r) for k, recs in records.items() for r in recs)
    else:
        pairs = records
    out: dict[bytes, tuple[Key, int, list[Any]]] = {}
    for key, record in pairs:
        kb = encode_key(key)
        if kb not in out:
            out[kb] = (key, key_group_of_bytes(kb, max_parallelism), [])
        out[kb][2].append(record)
    return out
