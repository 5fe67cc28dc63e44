"""A dataflow graph's window fed by its source is reduced to partials in stage 1
(:mod:`microbatch.runtime.graph_partials`): the windows, the steps after them, the
branch beside them and the dead letters equal the records path's batch by batch, through
a crash, a replay and a rescale, while runs with a late or keyless record go record by
record and meet the partials of the other runs in the same step."""

from __future__ import annotations

import dataclasses
import json
import random
from collections import defaultdict
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from microbatch import windows
from microbatch.dataflow import Dataflow
from microbatch.kafka import TopicPartition
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
    ProcessContext,
    windowed,
)
from microbatch.runtime.envelope import PARTIAL, RECORD, EnvelopeBuilder
from microbatch.runtime.graph_partials import counted_rows, reducing_windows
from microbatch.settings import Settings
from microbatch.sinks import read_parquet_sink
from tests.unit.runtime.test_protocol import Log
from tests.unit.runtime.test_window_pre_aggregation import (  # noqa: F401 - restore_switch
    BusiestPerWindow,
    PerPartition,
    dead_letters,
    restore_switch,
)

MIN = 60_000
WINDOWS = {
    "tumbling": lambda: windows.tumbling("1m").count().sum("amount").max("price")
    .final(allowed_lateness="10s"),
    # open across batches: a batch adds to windows whose timers are not due
    "hopping": lambda: windows.hopping("5m", every="1m").sum("amount").max("price").updates(),
    # a float sum: its bits depend on the order of its terms, so no run is reduced
    "float sum": lambda: windows.tumbling("1m").sum("price").count().final(),
}  # fmt: skip


class Clicks(KeyedProcessFunction):
    """The branch beside the window: each user's clicks so far."""

    def process(self, key: Any, records: Any, ctx: ProcessContext) -> None:
        seen = ctx.value("clicks")
        seen.set(seen.get(0) + len(records))
        ctx.emit({"user": key, "clicks": seen.get()})


def produce(log: Log, seed: int, start: int, n: int) -> None:
    """Out-of-order clicks over two partitions, none before ``start``; in odd batches,
    partition 1 also holds a record far behind the watermark and one without a user, so
    its run goes record by record while partition 0's is reduced."""
    rng = random.Random(seed)
    for i in range(n):
        behind = rng.choice([0, 0, rng.randrange(min(3 * MIN, i * 1_500 + 1))])
        ts = (start + i * 1_500 - behind) // 1_000 * 1_000
        amount = None if rng.random() < 0.1 else rng.randrange(100)
        click = {"user": f"u{rng.randrange(5)}", "ts": ts, "amount": amount, "price": i / 7}
        for topic in ("clicks", "visits"):
            if TopicPartition(topic, i % 2) in log.values:
                log.values[TopicPartition(topic, i % 2)].append(json.dumps(click).encode())
    if seed % 2:
        for click in ({"user": "u1", "ts": start // 4, "amount": 1, "price": 0.5},
                      {"ts": start, "amount": 2, "price": 0.5}):  # fmt: skip
            for topic in ("clicks", "visits"):
                if TopicPartition(topic, 1) in log.values:
                    log.values[TopicPartition(topic, 1)].append(json.dumps(click).encode())


#: (first event time, clicks) per batch: windows span batches; the last batch moves the
#: watermark a few seconds only, so it adds to windows whose timers are not due.
BATCHES = [(0, 160), (250_000, 160), (500_000, 160), (750_000, 160), (990_000, 10)]


#: The clicks' declared schema, for a source decoded as columns (its ``select`` makes
#: stage 1 key its records column by column: ``runtime.column_records``).
CLICK = JsonSchema({"user": "string", "ts": "long", "amount": "long", "price": "double"},
                   nullable=("user", "amount"))  # fmt: skip


def run_graph(
    tmp_path: Path, kind: str, on: bool, values: str = "payloads"
) -> tuple[dict[str, list], list, PerPartition]:
    """Per user: windows, re-keyed by window start into a step with timers; beside
    them, clicks per user. The :data:`BATCHES`, the second crashed in stage 2 and
    replayed, the later ones on 3 instances: every sink's rows batch by batch, the dead
    letters, and the executor (what crossed the first exchange). ``values``: the clicks
    as payloads; or decoded by :data:`CLICK` into columns (``"columns"``: through a
    ``select``; ``"declared"``: no column step), feeding only the window, while the
    clicks per user count the same clicks from a second topic."""
    windowed.PRE_AGGREGATE = on
    log = Log(partitions=2)
    flow = Dataflow(
        "graph",
        checkpoints=str(tmp_path / "checkpoints"),
        event_time=EventTime("ts", idle_timeout_s=None),
        dead_letters=DeadLetterSink(path=str(tmp_path / "dead"), max_ratio=1.0),
        max_parallelism=8,
        parallelism=2,
    )
    if values != "payloads":  # the window's source feeds nothing else: partials count only
        clicks = flow.source(KafkaSource(topics=("clicks",), value_schema=CLICK))
        if values == "columns":
            clicks = clicks.select("user", "ts", "amount", "price")
        visits = flow.source(KafkaSource(topics=("visits",)))  # the same clicks, for Clicks
        log.values |= {TopicPartition("visits", p): [] for p in range(2)}
        log.start |= dict.fromkeys(log.values, 0)
    else:
        clicks = visits = flow.source(KafkaSource(topics=("clicks",)))  # records as payloads
    if kind == "hopping":  # the window second in its level: its partials found by topic
        visits.key_by("user").process(Clicks(), uid="clicks").to(
            ParquetSink("clicks", str(tmp_path / "clicks"))
        )
    per_user = clicks.key_by("user").window(WINDOWS[kind](), uid="per-user")
    per_user.to(ParquetSink("windows", str(tmp_path / "windows")))
    if kind != "float sum":
        per_user.key_by("window_start").process(
            BusiestPerWindow(), uid="busiest",
            outputs=[ParquetSink("closed", str(tmp_path / "closed"))],
        ).to(ParquetSink("busiest", str(tmp_path / "busiest")))  # fmt: skip
    if kind != "hopping":
        visits.key_by("user").process(Clicks(), uid="clicks").to(
            ParquetSink("clicks", str(tmp_path / "clicks"))
        )
    pipeline = flow.build()
    assert pipeline.edges  # a graph: the source feeds two steps
    settings = dataclasses.replace(Settings.from_env(), spark_master="local[1]")
    executor = PerPartition(log)
    out: dict[str, list] = defaultdict(list)
    sinks = ["windows", "clicks"] + (["busiest", "closed"] if kind != "float sum" else [])
    for n, (start, clicks_in_batch) in enumerate(BATCHES):
        produce(log, seed=n, start=start, n=clicks_in_batch)
        runner = BatchRunner(None, pipeline, settings, executor=executor, broker=log)
        if n == 1:  # a crash inside stage 2, then the batch replayed
            with pytest.raises(InjectedCrash):
                runner.run(BatchOptions(crash_at="after_state_files", run_id="r"))
        result = runner.run(BatchOptions(run_id="r", parallelism=3 if n >= 2 else None))
        assert result.replayed == (n == 1)
        for sink in sinks:
            rows = read_parquet_sink(str(tmp_path / sink)).to_pylist()
            out[sink].append(sorted(json.dumps(r, sort_keys=True) for r in rows))
    return dict(out), dead_letters(tmp_path / "dead"), executor


@pytest.mark.parametrize("values", ["payloads", "columns", "declared"])
@pytest.mark.parametrize("kind", sorted(WINDOWS))
def test_a_graph_s_window_reduced_in_stage_one_equals_the_records_path(
    tmp_path: Path, kind: str, values: str
) -> None:
    want_out, want_dead, plain = run_graph(tmp_path / "records", kind, on=False, values=values)
    got_out, got_dead, reduced = run_graph(tmp_path / "partials", kind, on=True, values=values)

    def window_records(executor: PerPartition) -> int:
        """Records that crossed to the window (a later step's are marked with its uid)."""
        first = kind != "hopping"
        return sum(
            n for (k, topic), n in executor.kind_topics.items()
            if k == RECORD and (topic == "clicks" if first else "per-user" in str(topic))
        )  # fmt: skip

    assert not plain.kinds.get(PARTIAL)
    if kind == "float sum":
        assert not reduced.kinds.get(PARTIAL)
        assert window_records(reduced) == window_records(plain)
    else:  # partition 0's runs reduced; partition 1's with a late record went record by record
        assert reduced.kinds[PARTIAL]
        assert 0 < window_records(reduced) < window_records(plain) / 3
    assert len(want_out["windows"][-1]) > 10
    assert len(want_out["clicks"][-2]) == 5 * 4  # 5 users, in each of the first 4 batches
    # stage 1 sets a record aside whole when one of its ways out refuses it: late for
    # the clicks, or without a user; a late click of its own topic the window sets aside
    dead = {("late", None), ("missing_key", None)}
    if values != "payloads":
        dead.add(("late_window", "per-user"))
    assert {(d[0], d[-1]) for d in want_dead} == dead
    assert got_out == want_out
    assert got_dead == want_dead


def test_a_declared_schema_s_values_decoded_as_columns_give_the_records_each_alone_gives(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A graph's source with a declared schema and no column step is decoded as columns
    (``column_plan.decoded_as_columns``), its keys computed column-wise: every sink, batch
    by batch, and every dead letter (the keyless and the late click) equal what decoding
    each value by itself gives."""
    from microbatch.runtime.column_plan import record_column_steps
    from microbatch.runtime.stage_one import StageOne

    got = run_graph(tmp_path / "columns", "hopping", on=True, values="declared")
    assert got[2].kinds[PARTIAL]  # keyed as columns: the window's records reduced
    with monkeypatch.context() as m:  # stage 1 as before: only column steps make columns
        m.setattr(StageOne, "column_sources", property(lambda s: record_column_steps(s.pipeline)))
        want = run_graph(tmp_path / "values", "hopping", on=True, values="declared")
    assert not want[2].kinds.get(PARTIAL)  # each value decoded alone: records cross
    assert got[:2] == want[:2]


def test_only_windows_fed_by_sources_whose_aggregates_merge_column_wise_are_reduced() -> None:
    flow = Dataflow("g", checkpoints="/tmp/g", event_time=EventTime("ts"))
    source = flow.source(KafkaSource(topics=("clicks",)))
    keyed = source.key_by("user")
    sums = keyed.window(windows.tumbling("1m").sum("amount").final(), uid="sums")
    keyed.window(windows.session(gap="1s").count().final(), uid="sessions")
    keyed.window(windows.tumbling("1m").collect("amount").final(), uid="collected")
    sums.key_by("key").window(windows.tumbling("2m").max("sum_amount").final(), uid="after")
    graph = flow.build()

    assert set(reducing_windows(graph)) == {"sums"}
    windowed.PRE_AGGREGATE = False  # restore_switch puts it back
    assert reducing_windows(graph) == {}


def test_reduced_records_count_in_the_stat_rows_as_the_records_they_were() -> None:
    """The watermark and the batch's counts come from the ``stat`` rows: records
    standing only in partials must count there exactly as their rows would."""
    coords = [(0, 5, 1_000), (1, 7, 9_000), (0, 6, 4_000)]
    with_rows, with_counted = EnvelopeBuilder(), EnvelopeBuilder()
    for part, off, ts in coords:
        with_rows.record("clicks", part, off, 0, 0, 0, b"k", ts, b"{}")
    parts, offs, times = (list(c) for c in zip(*coords, strict=True))
    with_counted.counted.append(counted_rows("clicks", parts, offs, times))
    inputs = defaultdict(int, {("clicks", 0): 2, ("clicks", 1): 1})

    def stats(builder: EnvelopeBuilder) -> list[dict[str, Any]]:
        built = pa.Table.from_batches([builder.build(inputs, parallelism=2)])
        return built.filter(pa.compute.equal(built.column("kind"), "stat")).to_pylist()

    assert stats(with_counted) == stats(with_rows)


def test_partials_per_pane_and_per_window_merge_as_one_pass_over_their_records() -> None:
    """Stage 1 reduced integer amounts per pane; stage 2's records in the same batch had
    float amounts, reduced per window (a float sum is never split into panes): a row
    without an end covers its whole window."""
    from microbatch.runtime.windowed import with_partials
    from microbatch.windows import Hopping, Sum
    from microbatch.windows.aggregate import KEY, ORDER, TS
    from microbatch.windows.operator import WindowOperator

    op = WindowOperator(Hopping("2m", every="1m"), (Sum("total", "amount"),))

    def records(ts: list[int], amounts: list[Any], first: int) -> pa.Table:
        n = len(ts)
        return pa.table({KEY: ["a"] * n, TS: ts, ORDER: list(range(first, first + n)),
                         "amount": amounts})  # fmt: skip

    ints, floats = records([1_000, 70_000], [1, 2], 0), records([65_000, 130_000], [0.5, 4.0], 2)
    reduced, _ = op.pre_aggregate(ints, None)
    own, _ = op.pre_aggregate(floats, None)
    assert reduced is not None and "__window_end" in reduced.column_names
    assert own is not None and "__window_end" not in own.column_names

    got = op.merge(with_partials(op, own, reduced), {}, 10**9).rows
    want = op.run(pa.concat_tables([ints.cast(floats.schema), floats]), {}, None, 10**9).rows
    assert got == want and len(got) == 4
