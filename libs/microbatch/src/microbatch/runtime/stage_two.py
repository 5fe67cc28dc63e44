"""Stage 2 of a batch, one call per operator instance: keyed processing and staging.

Instance ``i`` of ``P`` gets every envelope row routed to it (its key-groups' records, the
dead letters it stages, the pending enrichment inputs it hands back to the driver), a copy
of every ``stat`` row of stage 1, and one ``tick`` row, so it runs even without input and
its timers fire. Stage 1 and stage 2 are one Spark job (nothing is materialised between
them), so the instance computes the batch watermark itself from the ``stat`` rows: every
instance sees the same rows and gets the same watermark. In order:

1. advance the watermark from the ``stat`` rows; load the state of the keys the batch
   touches — its records' keys and the keys with timers due by the watermark — from the
   base checkpoint's sorted runs (one bulk lookup through the executor's block cache; the
   rest of the state is never read);
2. call ``process(key, records)`` per key, keys in key-byte order, each key's records by
   (topic, partition, offset, seq) — a deterministic order, so a rerun computes the same;
3. advance the watermark: ``on_timer`` for each due timer, in timestamp order;
4. write one run with the keys it changed (merged with the newest runs when the size
   tiers say so);
5. stage each sink's output at deterministic keys;
6. return a JSON summary (state snapshot, staged files, stats, stage-1 totals, event time,
   pending elements) for the driver's manifest.

The state clock is the batch's recorded processing time, not the wall clock, so TTL
expiry is the same on every rerun. A base checkpoint of the older format (one state file
per instance) is restored whole once and written as the instance's first run: the
migration happens in the first batch after an upgrade.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from microbatch.checkpoint import InstanceSnapshot, Layout, Manifest
from microbatch.checkpoint.restore import instance_runs, restore_instance
from microbatch.errors import CheckpointError, ProcessError, error_text
from microbatch.gcpause import gc_paused
from microbatch.keygroups import key_group_range
from microbatch.runtime.column_plan import tap_values
from microbatch.runtime.column_taps import tap_tables
from microbatch.runtime.columnar import PayloadRuns, batch_records
from microbatch.runtime.envelope import (
    OUTPUT,
    PENDING,
    STAT,
    decode_payload,
    decode_payloads,
    partition_stats,
    stage_one_totals,
)
from microbatch.runtime.faults import crash_if
from microbatch.runtime.graph import first_uid, sides
from microbatch.runtime.graph_partials import reduced_partials
from microbatch.runtime.keyed_calls import DeadLetters, KeyCalls
from microbatch.runtime.pipeline import Pipeline
from microbatch.runtime.process import (
    Handled,
    KeyedBatch,
    KeyedProcessFunction,
    Sided,
    has_batch_hook,
)
from microbatch.runtime.records import InstanceResult, PendingInput, StageOneTotals
from microbatch.runtime.router import Router, next_step, step_index
from microbatch.runtime.side_columns import RecordsOnUse, side_columns
from microbatch.runtime.sorted_records import SortedRecords, in_source_order, key_runs
from microbatch.runtime.watermark import WatermarkState, advance
from microbatch.runtime.windowed import (
    carries_partials,
    partial_keys,
    run_partials,
    run_windows,
)
from microbatch.runtime.wire import tags_of
from microbatch.settings import Settings
from microbatch.sinks import StageContext
from microbatch.state import KeyedStateBackend
from microbatch.state.engine import (
    PROCESSING_TIMER,
    BlockCache,
    Loaded,
    RunRef,
    changed_entries,
    load_due_timers,
    load_keys,
    mark_all_changed,
    state_cache,
    write_batch_run,
)
from microbatch.storage import open_store

if TYPE_CHECKING:
    from microbatch.windows.api import WindowedAggregation
    from microbatch.windows.operator import BatchOutcome

RESULT_DDL = "instance INT, result STRING"


@dataclasses.dataclass(frozen=True)
class StageTwo:
    """The picklable per-instance function of stage 2: ``(instance,)`` and all its rows."""

    pipeline: Pipeline
    settings: Settings
    batch_id: int
    parallelism: int
    base_manifest: bytes | None
    #: The event-time state the batch starts with (``WatermarkState.to_json``).
    event_time: dict[str, Any] | None
    processing_time_ms: int
    crash_at: str | None = None
    #: This attempt's id, part of every name it stages (see ``StageContext.attempt``).
    attempt: str = ""
    #: The keyed step this stage runs: None for the first (the pipeline's ``process``),
    #: else the uid of one of ``pipeline.steps`` (see :meth:`for_step`).
    step: str | None = None

    def for_step(self, uid: str) -> StageTwo:
        """The stage of further keyed step ``uid``: its own function, state and names
        (its attempt id gets a suffix of the uid's hash, so its objects never collide
        with another step's)."""
        suffix = hashlib.sha256(uid.encode()).hexdigest()[:8]
        return dataclasses.replace(self, step=uid, attempt=f"{self.attempt}{suffix}")

    @property
    def process_fn(self) -> KeyedProcessFunction:
        if self.step is None:
            return self.pipeline.process
        return self.pipeline.steps[step_index(self.pipeline, self.step) - 1].process

    @property
    def is_last(self) -> bool:
        """Does this step stage the dead letters (the last keyed step does)?"""
        return next_step(self.pipeline, self.step) is None

    def __call__(self, key: tuple[Any, ...], table: pa.Table) -> pa.Table:
        instance = key[0].as_py() if hasattr(key[0], "as_py") else int(key[0])
        table = tags_of(self.pipeline).from_wire(table)
        with gc_paused():
            result = self.run(instance, table)
        return pa.table(
            {
                "instance": pa.array([instance], pa.int32()),
                "result": [json.dumps(result.to_json())],
            }
        )

    @property
    def _step_name(self) -> str:
        return "" if self.step is None else f"step {self.step!r}: "

    def _where(self, instance: int) -> str:
        step = "" if self.step is None else f" step {self.step!r}"
        return f"pipeline {self.pipeline.name!r} batch {self.batch_id}{step} instance {instance}"

    def open_state(self, store: Any, instance: int) -> InstanceState:
        """An empty backend for the instance's key-groups and the base's runs that serve
        them; a base of the older format is restored whole (the migration)."""
        clock = lambda: self.processing_time_ms / 1000  # noqa: E731 - deterministic TTL
        maxp = self.pipeline.max_parallelism
        own = key_group_range(maxp, self.parallelism, instance)
        cache = state_cache(store, self.settings)
        base = (
            None
            if self.base_manifest is None
            else Manifest.from_json(self.base_manifest, f"base of batch {self.batch_id}")
        )
        if base is not None and self.step is not None:
            base = base.for_operator(self.step)
        if base is not None and base.runs is None:
            backend, _ = restore_instance(store, base, self.parallelism, instance, clock=clock)
            mark_all_changed(backend)
            return InstanceState(
                backend, cache, [], Loaded(), None, base.checkpoint_id, migrated=True
            )
        backend = KeyedStateBackend(maxp, own, clock=clock)
        counts = None if base is None else base.key_counts
        base_id = None if base is None else base.checkpoint_id
        timers = None if base is None else base.processing_timer_counts
        return InstanceState(
            backend, cache, instance_runs(base, own), Loaded(), counts, base_id,
            base_processing_timers=timers,
        )  # fmt: skip

    def stage_one(self, table: pa.Table) -> tuple[StageOneTotals, WatermarkState]:
        """The batch's stage-1 totals (from the ``stat`` rows every instance receives) and
        the event-time state they advance the batch to (unchanged without event time):
        the one place a batch's watermark is computed."""
        stat = table.filter(pc.equal(table.column("kind"), STAT))
        cols = stat.select(["topic", "partition", "payload"]).to_pydict()
        totals = stage_one_totals(
            (topic, part, partition_stats(payload))
            for topic, part, payload in zip(
                cols["topic"], cols["partition"], cols["payload"], strict=True
            )
        )
        return totals, self.event_time_after(totals)

    def event_time_after(self, totals: StageOneTotals) -> WatermarkState:
        """The event-time state the batch's stage-1 ``totals`` advance it to."""
        state = WatermarkState.from_json(self.event_time)
        if self.pipeline.event_time is not None:
            state = advance(
                state, totals.max_event, self.processing_time_ms, self.pipeline.event_time
            )
        return state

    def run(self, instance: int, table: pa.Table) -> InstanceResult:
        return self.run_step(instance, table)[0]

    def run_step(self, instance: int, table: pa.Table) -> tuple[InstanceResult, Router]:
        """The instance's result, and its router: the rows it hands the next keyed step."""
        t0 = time.perf_counter()
        pipeline = self.pipeline
        totals, event_time = self.stage_one(table)
        watermark = event_time.watermark
        watermark_before = WatermarkState.from_json(self.event_time).watermark
        store = open_store(pipeline.checkpoints, self.settings)
        state = self.open_state(store, instance)
        stats: Counter[str] = Counter()
        dead = DeadLetters(pipeline.name, self.batch_id, self.step or pipeline.uid, stats)
        dead.add_rows_of(table)
        router = Router(self._where(instance), pipeline, self.step, self.parallelism, dead)
        outputs = router.outputs
        tables = self._source_taps(table, outputs)

        # Step 1: the batch's keys in processing order, and their state.
        recs = SortedRecords(table)
        runs = key_runs(recs.column("key"))
        firsts = pa.array([i for i, _ in runs], pa.int64())
        keys = recs.column("key").take(firsts).to_pylist()  # one per run: distinct, sorted
        key_groups = recs.at("key_group", firsts).to_pylist()
        stats["records"] = recs.num_rows
        # A window's partials (stage 1 reduced its records) add to their keys' open windows.
        reduced = None if carries_partials(table) else reduced_partials(table)
        loading = [*keys, *partial_keys(table, reduced)]
        restored = self._load_state(state, loading, watermark, instance, stats)
        t_restore = time.perf_counter()

        # Step 2: process() per key (or, for windows, the whole batch's columns).
        plain_records_of, side_of = self._plain_records_of(recs), self._sides(recs)
        records_of = sided_records(plain_records_of, side_of)
        calls = KeyCalls(
            self._where(instance), self._step_name, pipeline, self.process_fn, state.backend,
            watermark, watermark_before, self.processing_time_ms, router, dead,
        )  # fmt: skip
        if getattr(self.process_fn, "columnar", False):
            self._run_columnar(table, recs, records_of, state.backend, watermark_before,
                               watermark, router, dead, reduced)  # fmt: skip
        else:
            handled = self._process_batch(
                instance, runs, keys, key_groups, plain_records_of, side_of, state.backend,
                watermark, watermark_before, recs,
            )  # fmt: skip
            calls.process_keys(runs, keys, key_groups, records_of, recs.source, handled)

        # Step 3: timers, event time first.
        calls.fire_timers()
        t_process = time.perf_counter()

        # Step 4: the run of the keys it changed.
        attempt = with_task_attempt(self.attempt)
        snap = state.write(store, self.batch_id, instance, attempt)
        stats["runs"] = len(snap.runs or ())
        stats["state_bytes_written"] = snap.bytes_written
        t_state = time.perf_counter()
        crash_if(self.crash_at, "after_state_files", self._where(instance))

        # Step 5: stage sink output.
        stage_ctx = StageContext(
            pipeline.name, self.batch_id, instance, self.settings, store, Layout(), attempt
        )
        for name, parts in router.tables.items():  # a step's output kept as columns
            joined = pa.concat_tables(parts, promote_options="default")
            if outputs.get(name):  # and records emitted one by one besides: all as records
                outputs[name][:0] = joined.to_pylist()
            else:
                tables[name] = joined
        staged = {}
        for sink in pipeline.sinks:
            if sink.name in tables:
                staged[sink.name] = sink.stage_columns(stage_ctx, tables[sink.name])
            elif sink.name in outputs:
                staged[sink.name] = sink.stage(stage_ctx, outputs[sink.name])
        if self.is_last:
            if pipeline.dead_letters is not None:
                sink = pipeline.dead_letters
                staged[sink.name] = sink.stage(stage_ctx, dead.rows)
        else:
            router.forward_dead_letters(dead.rows, instance)
        t_stage = time.perf_counter()
        stats["dead_letters"] = len(dead.rows)
        for name, rows in outputs.items():
            stats[f"out.{name}"] = len(rows)
        for name, columns in tables.items():
            stats[f"out.{name}"] = columns.num_rows
        result = InstanceResult(
            instance=instance,
            stage_one=totals,
            event_time=event_time,
            pending=pending_inputs(table),
            snapshot=snap,
            staged=staged,
            counters=dict(stats),
            restored=restored,
            seconds={
                "restore": round(t_restore - t0, 4),
                "process": round(t_process - t_restore, 4),
                "state": round(t_state - t_process, 4),
                "stage": round(t_stage - t_state, 4),
            },
        )
        return result, router

    def _source_taps(self, table: pa.Table, outputs: dict[str, list[Any]]) -> dict[str, pa.Table]:
        """The records stage 1 sent to sinks fed before the first keyed step: as columns
        (returned per sink: a dataflow without keyed steps, of a declared schema), else
        appended to ``outputs`` as records."""
        pipeline = self.pipeline
        if self.step is not None or not pipeline.source_taps:
            return {}
        rows = in_source_order(table.filter(pc.equal(table.column("kind"), OUTPUT)))
        if tap_values(pipeline) is not None:
            tables = tap_tables(pipeline, rows)
            if tables:
                return tables
        names, payloads = rows.column("key").to_pylist(), rows.column("payload").to_pylist()
        for name, payload in zip(names, payloads, strict=True):
            outputs[name.decode()].append(decode_payload(payload))
        return {}

    def _load_state(
        self, state: InstanceState, keys: list[bytes], watermark: int | None, instance: int,
        stats: Counter[str],
    ) -> dict[str, int]:  # fmt: skip
        """Step 1: load the batch's keys and the keys with timers due from the base's runs
        (a migrated base is already whole); what was fetched."""
        backend = state.backend
        fetched_before = dataclasses.replace(state.cache.stats)
        if not state.migrated:
            try:
                load_keys(state.cache, state.runs, backend, dict.fromkeys(keys), state.loaded)
                if watermark is not None:
                    stats["timers_due"] = load_due_timers(
                        state.cache, state.runs, backend, watermark, state.loaded
                    )
                groups = state.timer_groups()
                if groups:  # the index of only the key-groups that have such timers
                    stats["processing_timers_due"] = load_due_timers(
                        state.cache, state.runs, backend, self.processing_time_ms,
                        state.loaded, PROCESSING_TIMER, groups,
                    )  # fmt: skip
            except CheckpointError as e:
                raise CheckpointError(
                    f"{self._where(instance)}: loading the state of key-groups "
                    f"{backend.key_groups} from base checkpoint {state.base_id} failed: {e}"
                ) from e
        stats["keys_loaded"] = len(state.loaded.timers)
        restored = state.cache.stats.since(fetched_before)
        stats["state_requests"] = restored["requests"]
        stats["state_bytes_fetched"] = restored["bytes"]
        return restored

    def _plain_records_of(self, recs: SortedRecords) -> Callable[[int, int], Any]:
        """The records at positions ``[i, j)`` of the processing order."""
        if self.step is None:
            return batch_records(self.pipeline, recs)
        # records handed on by the step before: always payloads
        return PayloadRuns(recs.column("payload"), decode_payloads)

    def _sides(self, recs: SortedRecords) -> list[int] | None:
        """The input side of each record in processing order (a join's); else None."""
        pipeline = self.pipeline
        side_of = sides(pipeline, self.step if self.step is not None else first_uid(pipeline))
        return None if side_of is None else recs.sides(side_of)

    def _process_batch(
        self, instance: int, runs: list[tuple[int, int]], keys: list[bytes],
        key_groups: list[int], records_of: Callable[[int, int], Any], side_of: list[int] | None,
        backend: KeyedStateBackend, watermark: int | None, watermark_before: int | None,
        recs: SortedRecords,
    ) -> Handled | None:  # fmt: skip
        """The keys the step's function processes at once (``process_batch``), if it
        does: every record of the instance (decoded when first read), and a join's
        sides as columns where it reads them."""
        fn = self.process_fn
        if not has_batch_hook(fn) or not runs:
            return None
        end = runs[-1][1]
        sides_array = None if side_of is None else np.asarray(side_of, dtype=np.int8)
        batch = KeyedBatch.on_backend(
            backend, key_groups, keys, RecordsOnUse(records_of, end),
            np.array([i for i, _ in runs] + [end], dtype=np.int64), sides_array,
            watermark, watermark_before,
            side_columns(self.pipeline, self.step, fn, recs, sides_array),
        )  # fmt: skip
        try:
            return fn.process_batch(batch)
        except Exception as e:  # a bug of the function's own: the batch fails, retried as is
            raise ProcessError(
                f"{self._where(instance)}: process_batch() of {type(fn).__name__} raised "
                f"over {len(runs)} keys: {error_text(e)}. Fix it (a key it cannot take it "
                "leaves to process()), or drop process_batch."
            ) from e

    def _run_columnar(
        self, table: pa.Table, recs: SortedRecords, records_of: Any, backend: KeyedStateBackend,
        watermark_before: int | None, watermark: int | None, router: Router, dead: DeadLetters,
        reduced: pa.Table | None,
    ) -> None:  # fmt: skip
        """A window over the whole batch's columns (or over stage 1's partials: of a
        chain's, or ``reduced``, a graph's, with the records stage 1 did not reduce), its
        results handed to the router grouped by their key's key-group."""
        operator = cast("WindowedAggregation", self.process_fn).operator
        outcomes: list[BatchOutcome] = []
        if carries_partials(table):  # stage 1 pre-aggregated: partials, no records
            dead.stats.update(run_partials(operator, backend, table, watermark, outcomes.append))
        else:
            everything = records_of(0, recs.num_rows)
            source = recs.source
            dead.stats.update(
                run_windows(
                    operator, backend, everything.columns(operator.fields_read()),
                    recs.column("key"),
                    recs.column("partition"), recs.column("offset"), recs.column("event_ts"),
                    watermark_before, watermark, outcomes.append,
                    lambda reason, error, i: dead(
                        reason, error,
                        raw_value=json.dumps(everything.record(i), default=str).encode(),
                        **source(i),
                    ),
                    reduced,
                )
            )  # fmt: skip
        for outcome in outcomes:
            columns = None if router.single else outcome.columns()
            if columns is None or not router.emit_columns(columns):
                router.emit_keyed_rows(outcome.rows)


def sided_records(
    records_of: Callable[[int, int], Any], side_of: list[int] | None
) -> Callable[[int, int], Any]:
    """``records_of`` with each record wrapped as :class:`Sided` when ``side_of`` gives
    its input (a join's records)."""
    if side_of is None:
        return records_of

    def sided(i: int, j: int) -> list[Sided]:
        return list(map(Sided, side_of[i:j], records_of(i, j)))

    return sided


def with_task_attempt(attempt: str) -> str:
    """``attempt`` as the names this task writes use it: with Spark's attempt number of
    the task when Spark ran it again (a retry, a speculative copy), so two attempts of one
    instance never write the same run or part — the manifest names the files of the one
    whose result the driver kept, whatever the other wrote (a non-deterministic enrichment
    may give other bytes)."""
    from pyspark import TaskContext

    task = TaskContext.get()
    number = task.attemptNumber() if task is not None else 0
    return f"{attempt}t{number}" if number else attempt


@dataclasses.dataclass
class InstanceState:
    """One instance's state for one batch: the backend it processes with (holding only
    the keys loaded), the block cache and runs it loads from, and the base's key counts."""

    backend: KeyedStateBackend
    cache: BlockCache
    runs: list[RunRef]
    loaded: Loaded
    base_counts: tuple[int, ...] | None
    base_id: int | None = None
    #: Restored whole from a format-1 checkpoint: every key is written to the first run.
    migrated: bool = False
    #: The base's processing-time timers per key-group (None: none anywhere).
    base_processing_timers: tuple[int, ...] | None = None

    def timer_groups(self) -> list[int]:
        """The instance's key-groups with processing-time timers in the base."""
        counts = self.base_processing_timers
        return [] if counts is None else [kg for kg in self.backend.key_groups if counts[kg]]

    def write(self, store: Any, batch_id: int, instance: int, attempt: str) -> InstanceSnapshot:
        """Step 4: prune what expired among the loaded keys, write the changed keys as one
        run (or merge), and count keys per key-group for the manifest."""
        backend = self.backend
        backend.prune_expired()
        entries = changed_entries(backend, self.loaded)
        own = backend.key_groups
        written = write_batch_run(
            store, Layout(), self.cache, self.runs, entries, batch_id, instance, attempt, own
        )
        changes = self.loaded.key_count_changes
        base = self.base_counts
        counts = {kg: (base[kg] if base else 0) + changes.get(kg, 0) for kg in own}
        before, timer_changes = self.base_processing_timers, self.loaded.processing_timer_changes
        timers = {kg: (before[kg] if before else 0) + timer_changes.get(kg, 0) for kg in own}
        return InstanceSnapshot(
            instance,
            own,
            {},
            frozenset(),
            None,
            written.bytes_written,
            runs=written.runs,
            key_counts=counts,
            processing_timer_counts=timers if any(timers.values()) else None,
        )


def pending_inputs(table: pa.Table) -> tuple[PendingInput, ...]:
    """The pending enrichment inputs routed to this instance, for the driver to store in
    the checkpoint."""
    rows = table.filter(pc.equal(table.column("kind"), PENDING))
    cols = rows.select(["topic", "partition", "offset", "payload"]).to_pydict()
    return tuple(
        PendingInput(topic, part, off, payload)
        for topic, part, off, payload in zip(
            cols["topic"], cols["partition"], cols["offset"], cols["payload"], strict=True
        )
    )
