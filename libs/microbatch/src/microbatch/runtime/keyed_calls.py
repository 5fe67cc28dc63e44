"""One instance's calls into its keyed step's function, and the dead letters they leave.

Stage 2 (:mod:`.stage_two`) loads the state of the batch's keys, then hands over here:
``process(key, records)`` once per key, keys in key-byte order, and ``on_timer`` once
per due timer, event time first, then processing time. Each call gets a fresh
:class:`~microbatch.runtime.process.ProcessContext`; what it emits goes to the
instance's :class:`~microbatch.runtime.router.Router`. When the pipeline dead-letters
failed calls (``on_process_error="dead_letter"``), the key's state and timers are copied
before the call and put back when it raises, so a failed call changes nothing.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from microbatch.errors import ProcessError, error_text
from microbatch.keygroups import decode_key
from microbatch.runtime.envelope import DEAD_LETTER, DeadLetterDetail
from microbatch.runtime.pipeline import Pipeline
from microbatch.runtime.process import Handled, KeyedProcessFunction, ProcessContext, Sided
from microbatch.runtime.router import Router
from microbatch.runtime.sorted_records import in_source_order
from microbatch.state import KeyedStateBackend


class DeadLetters:
    """The dead-letter rows of one instance of one step, counted by reason in ``stats``:
    what the last keyed step stages, or what a step before it hands on."""

    def __init__(self, pipeline: str, batch_id: int, step: str | None, stats: Counter[str]) -> None:
        self.pipeline, self.batch_id, self.step, self.stats = pipeline, batch_id, step, stats
        self.rows: list[dict[str, Any]] = []

    def __call__(self, reason: str, error: str, **src: Any) -> None:
        """One dead letter; ``src`` may name its topic, partition, offset, attempts, raw
        key and value, and the step it failed in (this step by default)."""
        self.stats[f"dead_letters.{reason}"] += 1
        self.rows.append(
            {
                "pipeline": self.pipeline,
                "batch_id": self.batch_id,
                "reason": reason,
                "error": error,
                "topic": src.get("topic"),
                "partition": src.get("partition"),
                "offset": src.get("offset"),
                "attempts": src.get("attempts"),
                "raw_key": src.get("raw_key"),
                "raw_value": src.get("raw_value"),
                "step": src.get("step", self.step),
            }
        )

    def add_rows_of(self, table: pa.Table) -> None:
        """The dead letters of stage 1 and of the steps before, in source order."""
        rows = in_source_order(table.filter(pc.equal(table.column("kind"), DEAD_LETTER)))
        for row in rows.select(["topic", "partition", "offset", "payload"]).to_pylist():
            detail = DeadLetterDetail.from_payload(row["payload"])
            self(
                detail.reason, detail.error, topic=row["topic"], partition=row["partition"],
                offset=row["offset"], attempts=detail.attempts, raw_key=detail.raw_key,
                raw_value=detail.raw_value, step=detail.step,
            )  # fmt: skip


class KeyCalls:
    """The calls of one instance of one keyed step into its function, for one batch."""

    def __init__(
        self,
        where: str,
        step_name: str,
        pipeline: Pipeline,
        process_fn: KeyedProcessFunction,
        backend: KeyedStateBackend,
        watermark: int | None,
        watermark_before: int | None,
        processing_time_ms: int,
        router: Router,
        dead: DeadLetters,
    ) -> None:
        self.where, self.step_name = where, step_name
        self.process_fn, self.backend, self.router, self.dead = process_fn, backend, router, dead
        self.watermark, self.before = watermark, watermark_before  # batch's end, start
        self.processing_time_ms = processing_time_ms
        self.undo = pipeline.on_process_error != "fail"
        self.stats = dead.stats

    def process_keys(
        self,
        runs: Sequence[tuple[int, int]],
        keys: Sequence[bytes],
        key_groups: Sequence[int],
        records_of: Callable[[int, int], Sequence[Any]],
        source: Callable[[int], dict[str, Any]],
        handled: Handled | None = None,
    ) -> None:
        """``process(key, records)`` per key: ``runs[k]`` are the positions of key
        ``keys[k]``'s records in processing order (``records_of``), ``source`` the
        coordinates of the record at a position (for errors). A key in ``handled`` (the
        function's ``process_batch`` did it) gets no call: its output takes its place."""
        backend, process_fn = self.backend, self.process_fn
        visit: Iterable[int] = range(len(runs))
        emitted: dict[int, list[Any]] = {}
        if handled is not None:  # only the keys left to process and those with output
            flags = handled.keys.tolist()
            emitted = {k: rows for k, rows in handled.emitted.items() if flags[k]}
            left = np.nonzero(~handled.keys)[0].tolist()
            visit = sorted([*left, *emitted]) if emitted else left
            done = int(handled.keys.sum())
            self.stats["keys"] += done
            self.stats["keys_batched"] += done
            if handled.columns is not None:
                self.stats["keys_as_columns"] += done
            if handled.columns is not None and handled.columns.num_rows:
                assert handled.column_keys is not None
                groups = np.asarray(key_groups, dtype=np.int64)[handled.column_keys]
                self.router.emit_table(handled.columns, groups)
        for k in visit:
            (i, j), key_bytes, kg = runs[k], keys[k], key_groups[k]
            rows = emitted.get(k)
            if rows is not None:
                self.router.emit([(None, row) for row in rows], kg)
                continue
            records = records_of(i, j)
            key = decode_key(key_bytes)
            backup = KeyBackup(backend, kg, key_bytes) if self.undo else None
            ctx = ProcessContext(
                backend.for_placed(key, key_bytes, kg), self.watermark, self.processing_time_ms,
                watermark_before=self.before,
            )  # fmt: skip
            try:
                process_fn.process(key, records, ctx)
            except Exception as e:
                if backup is None:
                    at = source(i)
                    first = f"{at['topic']}[{at['partition']}]@{at['offset']}"
                    raise ProcessError(
                        f"{self.where}: process() raised for key {key!r} (key-group {kg}, "
                        f"{j - i} records from {first}): {error_text(e)}. Fix the function, "
                        "or set on_process_error='dead_letter'."
                    ) from e
                backup.restore()
                for r in range(i, j):
                    self.dead(
                        "process_failed", error_text(e), **source(r),
                        raw_value=json.dumps(records[r - i], default=str).encode(),
                    )  # fmt: skip
            else:
                self.router.emit(ctx.emitted, kg)
                self._dead_letters_of(ctx)
            self.stats["keys"] += 1

    def fire_timers(self) -> None:
        """``on_timer`` for every timer due: event time by the watermark, then processing
        time by the batch's recorded processing time."""
        if self.watermark is not None:
            self.backend.advance_watermark(self.watermark, self._timer_caller("event_time"))
        self.backend.advance_processing_time(
            self.processing_time_ms, self._timer_caller("processing_time")
        )

    def _timer_caller(self, domain: str) -> Callable[[Any, int], None]:
        fired = "timers_fired" if domain == "event_time" else "processing_timers_fired"

        def on_timer(key_ctx: Any, ts: int) -> None:
            self.stats[fired] += 1
            ctx = ProcessContext(
                key_ctx, self.watermark, self.processing_time_ms, domain, self.before
            )
            backup = None
            if self.undo:
                backup = KeyBackup(self.backend, key_ctx.key_group, key_ctx.key_bytes)
            try:
                self.process_fn.on_timer(key_ctx.key, ts, ctx)
            except Exception as e:
                if backup is None:
                    raise ProcessError(
                        f"{self.where}: on_timer() raised for key {key_ctx.key!r} timer {ts}: "
                        f"{error_text(e)}. Fix the function, or set "
                        "on_process_error='dead_letter'."
                    ) from e
                backup.restore()
                body = {"key": repr(key_ctx.key), "timer": ts}
                self.dead("timer_failed", error_text(e), raw_value=json.dumps(body).encode())
            else:
                self.router.emit(ctx.emitted, key_ctx.key_group)
                self._dead_letters_of(ctx)

        return on_timer

    def _dead_letters_of(self, ctx: ProcessContext) -> None:
        """What ``ctx.dead_letter`` sent: dead letters naming the step and the key."""
        for reason, error, record in ctx.dead:
            body = record.record if isinstance(record, Sided) else record
            self.dead(
                reason, f"{self.step_name}key {ctx.key!r}: {error}",
                raw_value=json.dumps(body, default=str).encode(),
            )  # fmt: skip


class KeyBackup:
    """The state and timers of one key, to undo a failed call (dead-letter policy)."""

    def __init__(self, backend: KeyedStateBackend, kg: int, key_bytes: bytes) -> None:
        self.backend, self.kg, self.key_bytes = backend, kg, key_bytes
        self.entries = {
            name: _copy(table.get(key_bytes))
            for name, table in backend.groups.get(kg, {}).items()
            if key_bytes in table
        }
        self.timers = backend.timers.of_key(kg, key_bytes)
        self.processing_timers = backend.processing_timers.of_key(kg, key_bytes)

    def restore(self) -> None:
        for name, table in self.backend.groups.get(self.kg, {}).items():
            if name in self.entries:
                table[self.key_bytes] = _copy(self.entries[name])
            else:
                table.pop(self.key_bytes, None)
        for ts in self.backend.timers.of_key(self.kg, self.key_bytes):
            self.backend.delete_timer(self.kg, self.key_bytes, ts)
        for ts in self.timers:
            self.backend.register_timer(self.kg, self.key_bytes, ts)
        for ts in self.backend.processing_timers.of_key(self.kg, self.key_bytes):
            self.backend.delete_processing_timer(self.kg, self.key_bytes, ts)
        for ts in self.processing_timers:
            self.backend.register_processing_timer(self.kg, self.key_bytes, ts)


def _copy(entry: Any) -> Any:
    if isinstance(entry, list):
        return list(entry)
    if isinstance(entry, dict):
        return dict(entry)
    return entry
