"""Windows pre-aggregated in stage 1 (local-global aggregation) through the whole batch
protocol — real stage 1 per source partition, as Spark's tasks run it, and stage 2 —
give the same windows and the same dead letters as the records path, batch by batch."""

from __future__ import annotations

import dataclasses
import json
import random
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pytest

from microbatch import windows
from microbatch.dataflow import Dataflow
from microbatch.kafka import BatchPlan, TopicPartition
from microbatch.runtime import (
    BatchOptions,
    BatchRunner,
    DeadLetterSink,
    EventTime,
    InjectedCrash,
    JsonSchema,
    KafkaSource,
    KeyedProcessFunction,
    ParquetSink,
    Pipeline,
    ProcessContext,
    windowed,
)
from microbatch.runtime.envelope import PARTIAL, RECORD, RESULT, SOURCE_COLUMNS, ticks
from microbatch.runtime.execute import Execution, has_input, merged_results
from microbatch.runtime.records import InstanceResult
from microbatch.runtime.spine import level_instance, step_instance, step_levels, step_results
from microbatch.runtime.stage_one import StageOne
from microbatch.runtime.stage_two import StageTwo
from microbatch.runtime.wire import tags_of
from microbatch.settings import Settings
from microbatch.sinks import read_parquet_sink
from tests.unit.runtime.test_protocol import InProcess, Log

MIN = 60_000
SCHEMA = JsonSchema(
    {"user": "string", "ts": "long", "amount": "long", "price": "double"},
    nullable=("amount",),
)


class PerPartition(InProcess):
    """Stage 1 with one Arrow batch per planned range (a Spark task each: partials are
    per task), then stage 2 per instance — for a dataflow, every keyed step's body over
    each instance's rows, as the spine's exchanges hand them on; counts the kinds of rows
    stage 1 exchanged."""

    def __init__(self, log: Log) -> None:
        super().__init__(log)
        self.kinds: dict[str, int] = defaultdict(int)
        self.kind_topics: dict[tuple[str, str | None], int] = defaultdict(int)

    def stage_one_rows(
        self, plan: BatchPlan, stage: StageTwo, pending: pa.Table | None, watermark: int | None
    ) -> list[pa.Table]:
        if not has_input(plan, pending):
            return []
        ranges = []
        for r in plan.ranges:
            values = self.log.values[TopicPartition(r.topic, r.partition)][r.start : r.end]
            cols = (
                [r.topic] * len(values), [r.partition] * len(values),
                list(range(r.start, r.end)), [None] * len(values), values,
            )  # fmt: skip
            ranges.append(pa.RecordBatch.from_pydict(dict(zip(SOURCE_COLUMNS, cols, strict=True))))
        process = StageOne(stage.pipeline, stage.parallelism, watermark, stage.crash_at)
        tags = tags_of(stage.pipeline)  # stage 1's rows as they cross the exchange, read back
        return [tags.from_wire(pa.Table.from_batches([b])) for b in process(ranges)]

    def execute(
        self, plan: BatchPlan, stage: StageTwo, pending: pa.Table | None, watermark: int | None
    ) -> Execution:
        schema = windowed.exchange_schema(stage.pipeline)
        exchanged = self.stage_one_rows(plan, stage, pending, watermark)
        for t in exchanged:
            for kind, topic in zip(*t.select(["kind", "topic"]).to_pydict().values(), strict=True):
                self.kinds[kind] += 1
                self.kind_topics[kind, topic] += 1
        if stage.pipeline.steps:
            return self.spine(stage, [*exchanged, ticks(range(stage.parallelism), schema)])
        results = []
        for i in range(stage.parallelism):
            mine = [t.filter(pc.equal(t.column("instance"), i)) for t in exchanged]
            table = pa.concat_tables(
                [*(pa.table(t, schema=schema) for t in mine), ticks([i], schema)]
            )
            out = stage((i,), table)
            results.append(InstanceResult.from_json(json.loads(out.column("result")[0].as_py())))
        return Execution(tuple(results), None)

    @staticmethod
    def spine(stage: StageTwo, rows: list[pa.Table]) -> Execution:
        """Each level of keyed steps over each instance's rows (what ``repartitionById``
        gives it), its output the next level's input, as
        :func:`~microbatch.runtime.spine.spine_frame`: every row crosses on its wire
        codes."""
        tags = tags_of(stage.pipeline)
        rows = [tags.to_wire(t) for t in rows]
        for level in step_levels(stage):
            body = step_instance(level[0]) if len(level) == 1 else level_instance(level)
            out: list[pa.Table] = []
            for i in range(stage.parallelism):
                mine = [
                    b
                    for t in rows
                    for b in t.filter(pc.equal(t.column("instance"), i)).to_batches()
                ]
                out.extend(pa.Table.from_batches([b]) for b in body(iter(mine)) if b.num_rows)
            rows = out
        results = tags.from_wire(pa.concat_tables(rows))
        results = results.filter(pc.equal(results.column("kind"), RESULT)).to_pylist()
        first, steps = step_results(results, stage)
        return Execution(merged_results(first, steps), None, steps)


def produce(log: Log, seed: int, start: int, n: int) -> None:
    """Out-of-order events over two partitions, event times on a 1 s grid (ties across
    partitions), some null amounts, and a few far behind any watermark."""
    rng = random.Random(seed)
    for i in range(n):
        ts = (start + i * 1_500 - rng.choice([0, 0, rng.randrange(3 * MIN)])) // 1_000 * 1_000
        amount = None if rng.random() < 0.1 else rng.randrange(100)
        event = {"user": f"u{rng.randrange(5)}", "ts": ts, "amount": amount, "price": i / 7}
        log.values[TopicPartition("clicks", i % 2)].append(json.dumps(event).encode())
    for p in (0, 1):
        late = {"user": "u1", "ts": start // 4, "amount": 1, "price": 0.5}
        log.values[TopicPartition("clicks", p)].append(json.dumps(late).encode())


#: A set of the non-null values, as a sorted list (plain data for the codec).
DISTINCT = {
    "init": list, "add": lambda a, v: a if v is None else sorted({*a, v}),
    "merge": lambda a, b: sorted({*a, *b}), "result": len, "pre_aggregate": True,
}  # fmt: skip
KINDS = {
    "tumbling": lambda: windows.tumbling("1m").count().sum("amount").min("amount").max("price")
    .mean("amount").first("amount").last("amount").final(allowed_lateness="10s"),
    "hopping": lambda: windows.hopping("2m", every="1m").sum("amount").max("price")
    .last("price").updates(),
    "session": lambda: windows.session(gap="3s").count().first("price").max("amount").final(),
    "session updates": lambda: windows.session(gap="2s").count().last("amount").updates(),
    # Python partials: custom accumulators cross encoded, collect's values as lists
    "custom hopping": lambda: windows.hopping("2m", every="1m").collect("amount")
    .aggregate("distinct", "amount", **DISTINCT).updates(),
    "custom session": lambda: windows.session(gap="3s").count().aggregate(
        "distinct", "amount", **DISTINCT).final(allowed_lateness="2s"),
}  # fmt: skip


def run_all(tmp_path: Path, kind: str, on: bool) -> tuple[list, list, dict[str, int]]:
    windowed.PRE_AGGREGATE = on
    log = Log(partitions=2)
    pipeline = Pipeline(
        name="windows",
        source=KafkaSource(topics=("clicks",), value_schema=SCHEMA),
        key_by="user",
        process=KINDS[kind](),
        event_time=EventTime("ts", idle_timeout_s=None),
        sinks=[ParquetSink("out", str(tmp_path / "out"))],
        dead_letters=DeadLetterSink(path=str(tmp_path / "dead"), max_ratio=1.0),
        checkpoints=str(tmp_path / "checkpoints"),
        max_parallelism=8,
        parallelism=2,
    )
    settings = dataclasses.replace(Settings.from_env(), spark_master="local[1]")
    executor = PerPartition(log)
    out = []
    for n in range(4):
        produce(log, seed=n, start=n * 240_000, n=160)
        BatchRunner(None, pipeline, settings, executor=executor, broker=log).run()
        rows = read_parquet_sink(str(tmp_path / "out")).to_pylist()
        out.append(sorted(json.dumps(r, sort_keys=True) for r in rows))  # batch by batch
    return out, dead_letters(tmp_path / "dead"), dict(executor.kinds)


def dead_letters(path: Path) -> list[tuple[Any, ...]]:
    """The dead letters at ``path``, sorted, without the batch they came in."""
    dead = read_parquet_sink(str(path)).to_pylist()
    fields = ("reason", "error", "topic", "partition", "offset", "raw_key", "raw_value", "step")
    return sorted(tuple(d[f] for f in fields) for d in dead)


@pytest.fixture(autouse=True)
def restore_switch():
    """Each test sets ``windowed.PRE_AGGREGATE``; the next finds it as it was."""
    before = windowed.PRE_AGGREGATE
    yield
    windowed.PRE_AGGREGATE = before


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_pre_aggregated_windows_equal_the_records_path_batch_by_batch(
    tmp_path: Path, kind: str
) -> None:
    want_out, want_dead, plain = run_all(tmp_path / "records", kind, on=False)
    got_out, got_dead, reduced = run_all(tmp_path / "partials", kind, on=True)

    assert plain.get(RECORD) and not plain.get(PARTIAL)
    assert reduced.get(PARTIAL) and not reduced.get(RECORD)  # only partials crossed
    assert reduced[PARTIAL] < plain[RECORD]
    assert len(want_out[-1]) > 10 and want_dead  # windows emitted, late records
    assert {d[0] for d in want_dead} == {"late_window"}
    assert got_out == want_out
    assert got_dead == want_dead


@pytest.mark.parametrize("on", [True, False])
def test_a_key_s_windows_close_batch_by_batch_without_records_of_it(
    tmp_path: Path, on: bool
) -> None:
    """Key ``a`` has three windows open after batch 1 and no record after it: each
    later batch that closes one must load ``a`` (its timer) and emit exactly that one."""
    windowed.PRE_AGGREGATE = on
    log = Log(partitions=1)
    pipeline = Pipeline(
        name="windows",
        source=KafkaSource(topics=("clicks",), value_schema=SCHEMA),
        key_by="user",
        process=windows.hopping("3m", every="1m").count().final(),
        event_time=EventTime("ts", idle_timeout_s=None),
        sinks=[ParquetSink("out", str(tmp_path / "out"))],
        checkpoints=str(tmp_path / "checkpoints"),
        max_parallelism=8,
        parallelism=2,
    )
    settings = dataclasses.replace(Settings.from_env(), spark_master="local[1]")
    batches = [[("a", 10_000), ("a", 70_000), ("a", 130_000)], [("b", 185_000)],
               [("b", 245_000)], [("b", 400_000)]]  # fmt: skip
    seen: list[tuple[str, int, int]] = []
    emitted = []
    for events in batches:  # the watermark: the batch's latest event time
        for user, ts in events:
            event = {"user": user, "ts": ts, "amount": 1, "price": 0.5}
            log.values[TopicPartition("clicks", 0)].append(json.dumps(event).encode())
        BatchRunner(None, pipeline, settings, executor=PerPartition(log), broker=log).run()
        rows = read_parquet_sink(str(tmp_path / "out")).to_pylist()
        now = sorted((r["key"], r["window_start"], r["count"]) for r in rows)
        emitted.append([r for r in now if r not in seen])
        seen = now

    assert emitted == [
        [("a", -2 * MIN, 1), ("a", -MIN, 2)],  # 130 s closes the windows ending by then
        [("a", 0, 3)],  # [0, 3m) ends at 180 s
        [("a", MIN, 2), ("b", MIN, 1)],  # [1m, 4m)
        [("a", 2 * MIN, 1), ("b", 2 * MIN, 2), ("b", 3 * MIN, 2)],
    ]


def test_windows_that_cannot_be_merged_exactly_are_not_pre_aggregated(tmp_path: Path) -> None:
    def made(process) -> Pipeline:
        return Pipeline(
            name="windows",
            source=KafkaSource(topics=("clicks",), value_schema=SCHEMA),
            key_by="user",
            process=process,
            event_time=EventTime("ts", idle_timeout_s=None),
            sinks=[ParquetSink("out", str(tmp_path / "out"))],
            checkpoints=str(tmp_path / "checkpoints"),
        )

    assert windowed.pre_aggregation(made(windows.tumbling("1m").sum("amount").final()))
    float_sum = made(windows.tumbling("1m").mean("price").final())  # order-dependent bits
    ordered = made(  # a custom aggregate that did not opt in: its records fold in one run
        windows.tumbling("1m")
        .aggregate("a", "amount", init=list, add=lambda a, v: [*a, v], merge=list.__add__,
                   result=tuple)
        .final()
    )  # fmt: skip
    for pipeline in (float_sum, ordered):
        assert windowed.pre_aggregation(pipeline) is None
        assert windowed.exchange_schema(pipeline).names[-1] == "value_price"
    schemaless = dataclasses.replace(float_sum, source=KafkaSource(topics=("clicks",)))
    assert windowed.pre_aggregation(schemaless) is None

    # A graph whose source also feeds a later step directly: that step's records would
    # ride through the first exchange, which carries only partials.
    flow = Dataflow("graph", checkpoints=str(tmp_path / "graph"), event_time=EventTime("ts"))
    source = flow.source(KafkaSource(topics=("clicks",), value_schema=SCHEMA))
    source.key_by("user").window(windows.tumbling("1m").sum("amount").final(), uid="w").to(
        ParquetSink("w", str(tmp_path / "w"))
    )
    source.key_by("ts").process(BusiestPerWindow(), uid="raw").to(
        ParquetSink("raw", str(tmp_path / "raw"))
    )
    graph = flow.build()
    assert graph.edges and windowed.pre_aggregation(graph) is None


def _rank(row: dict[str, Any]) -> tuple[int, str]:
    return -row["sum_amount"], row["key"]


class BusiestPerWindow(KeyedProcessFunction):
    """Per window start (q5's shape): the key with the largest sum so far, emitted each
    batch it changes and, on a timer at the window's end, to ``closed``. Ties go to the
    smaller key, so the result does not depend on the order rows arrive in."""

    def process(self, key: Any, records: Sequence[Any], ctx: ProcessContext) -> None:
        best = ctx.value("best")
        for r in records:
            row = {"window_start": key, "key": r["key"], "sum_amount": r["sum_amount"] or 0}
            held = best.get(None)
            if held is None or _rank(row) < _rank(held):
                best.set(row)
            ctx.register_timer(r["window_end"])
        ctx.emit(best.get())

    def on_timer(self, key: Any, timestamp_ms: int, ctx: ProcessContext) -> None:
        ctx.emit({**ctx.value("best").get(), "closed_at": timestamp_ms}, to="closed")


CHAINED = {
    "tumbling": lambda: windows.tumbling("1m").count().sum("amount").final(allowed_lateness="10s"),
    "hopping": lambda: windows.hopping("2m", every="1m").sum("amount").max("price").updates(),
}


def run_chain(tmp_path: Path, kind: str, on: bool) -> tuple[dict[str, list], list, dict[str, int]]:
    """A window re-keyed by its window start into a keyed step with timers, its rows also
    to a sink, over four batches — the second crashed inside stage 2 and replayed, the
    last two rescaled from 2 instances to 3: every sink's rows batch by batch in the order
    written (a later step's records come in the window's order), the dead letters, stage
    1's row kinds."""
    windowed.PRE_AGGREGATE = on
    log = Log(partitions=2)
    flow = Dataflow(
        "busiest",
        checkpoints=str(tmp_path / "checkpoints"),
        event_time=EventTime("ts", idle_timeout_s=None),
        dead_letters=DeadLetterSink(path=str(tmp_path / "dead"), max_ratio=1.0),
        max_parallelism=8,
        parallelism=2,
    )
    per_user = (
        flow.source(KafkaSource(topics=("clicks",), value_schema=SCHEMA))
        .key_by("user")
        .window(CHAINED[kind](), uid="per-user")
    )
    per_user.to(ParquetSink("windows", str(tmp_path / "windows")))
    per_user.key_by("window_start").process(
        BusiestPerWindow(), uid="busiest", outputs=[ParquetSink("closed", str(tmp_path / "closed"))]
    ).to(ParquetSink("busiest", str(tmp_path / "busiest")))
    pipeline = flow.build()
    assert pipeline.steps and not pipeline.edges  # a chain: window, then a re-keyed step
    settings = dataclasses.replace(Settings.from_env(), spark_master="local[1]")
    executor = PerPartition(log)
    out: dict[str, list] = defaultdict(list)
    for n in range(4):
        produce(log, seed=n, start=n * 240_000, n=160)
        runner = BatchRunner(None, pipeline, settings, executor=executor, broker=log)
        if n == 1:  # a crash inside stage 2, then the batch replayed
            with pytest.raises(InjectedCrash):
                runner.run(BatchOptions(crash_at="after_state_files", run_id="r"))
        result = runner.run(BatchOptions(run_id="r", parallelism=3 if n >= 2 else None))
        assert result.parallelism == (3 if n >= 2 else 2)  # rescaled
        assert result.replayed == (n == 1)
        for sink in ("windows", "busiest", "closed"):
            rows = read_parquet_sink(str(tmp_path / sink)).to_pylist()
            out[sink].append([json.dumps(r, sort_keys=True) for r in rows])  # in order
    return dict(out), dead_letters(tmp_path / "dead"), dict(executor.kinds)


@pytest.mark.parametrize("kind", sorted(CHAINED))
def test_a_window_followed_by_a_re_keyed_step_is_pre_aggregated_with_equal_results(
    tmp_path: Path, kind: str
) -> None:
    want_out, want_dead, plain = run_chain(tmp_path / "records", kind, on=False)
    got_out, got_dead, reduced = run_chain(tmp_path / "partials", kind, on=True)

    assert plain.get(RECORD) and not plain.get(PARTIAL)
    assert reduced.get(PARTIAL) and not reduced.get(RECORD)  # only partials crossed first
    assert reduced[PARTIAL] < plain[RECORD]
    assert len(want_out["windows"][-1]) > 10 and len(want_out["busiest"][-1]) > 3
    assert want_out["closed"][-1] and want_dead
    assert {(d[0], d[-1]) for d in want_dead} == {("late_window", "per-user")}
    assert got_out == want_out
    assert got_dead == want_dead
