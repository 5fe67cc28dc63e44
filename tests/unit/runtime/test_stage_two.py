"""Stage 2's parts that need no Spark (its instances on Spark: tests/integration)."""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from types import SimpleNamespace

import pyarrow as pa
import pyarrow.compute as pc
import pytest

from microbatch.errors import BatchError
from microbatch.runtime import EventTime, KafkaSource, KeyedProcessFunction, Pipeline
from microbatch.runtime.envelope import ENVELOPE_SCHEMA, EnvelopeBuilder
from microbatch.runtime.protocol import agreed_stage_one
from microbatch.runtime.records import StageOneTotals
from microbatch.runtime.sorted_records import SortedRecords, key_runs
from microbatch.runtime.stage_two import StageTwo
from microbatch.runtime.watermark import WatermarkState
from microbatch.settings import Settings


class Noop(KeyedProcessFunction):
    def process(self, key, records, ctx) -> None:
        pass


def test_key_runs_are_the_row_ranges_of_equal_keys() -> None:
    keys = pa.array([b"a", b"a", b"b", b"c", b"c", b"c", b"d"], pa.binary())

    assert key_runs(keys) == [(0, 2), (2, 3), (3, 6), (6, 7)]


def test_key_runs_reads_across_chunks_and_edge_cases() -> None:
    chunked = pa.chunked_array([[b"a", b"a"], [b"a", b"b"], [b"b"]], pa.binary())

    assert key_runs(chunked) == [(0, 3), (3, 5)]
    assert key_runs(pa.array([b"x"], pa.binary())) == [(0, 1)]
    assert key_runs(pa.array([], pa.binary())) == []
    assert key_runs(pa.chunked_array([], pa.binary())) == []


def _stage_two(**event_time: float) -> StageTwo:
    pipe = Pipeline(
        name="p",
        source=KafkaSource(topics=("t",)),
        key_by="user",
        process=Noop(),
        checkpoints="/tmp/x",
        event_time=EventTime(field="ts", **event_time),
        max_parallelism=16,
        parallelism=2,
    )
    return StageTwo(pipe, Settings.from_env(), 3, 2, None, None, 1_000_000)


def _stage_one_rows(*tasks: list[tuple[int, int]]) -> pa.Table:
    """What stage 1 hands instance 0: each task's rows (partition, event time), all routed
    to it, and the task's ``stat`` rows meant for it (each instance gets its own copy)."""
    batches = []
    for rows in tasks:
        out = EnvelopeBuilder()
        for off, (part, ts) in enumerate(rows):
            out.record("t", part, off, 0, 0, 0, b"k", ts, b"{}")
        batches.append(out.build(Counter(("t", p) for p, _ in rows), parallelism=2))
    table = pa.Table.from_batches(batches, schema=ENVELOPE_SCHEMA)
    return table.filter(pc.equal(table.column("instance"), 0))


def test_every_instance_gets_the_batch_watermark_from_the_stat_rows() -> None:
    """Stage 1 and 2 are one Spark job: an instance learns the watermark from the stat
    rows alone; partitions split over tasks take their max, the pipeline the min."""
    table = _stage_one_rows([(0, 5_000), (1, 9_000)], [(0, 7_000), (0, 6_000)])

    totals, event_time = _stage_two(allowed_lateness_s=1).stage_one(table)

    assert event_time.watermark == 7_000 - 1_000  # min(t/0: 7000, t/1: 9000) - lateness
    assert totals.max_event == {"t/0": 7_000, "t/1": 9_000}
    assert totals.inputs == totals.records == 4


def test_an_instance_without_stat_rows_keeps_the_watermark_it_started_with() -> None:
    ticks_only = _stage_one_rows()
    stage = dataclasses.replace(
        _stage_two(),
        event_time={"watermark": 4_000, "partitions": {"t/0": [5_000, 1_000_000]}},
    )

    assert stage.stage_one(ticks_only)[1].watermark == 5_000  # t/0 is still active: its max counts


def test_instances_that_saw_different_stage_one_output_commit_nothing() -> None:
    def result(inputs: int) -> SimpleNamespace:  # the two fields of an InstanceResult it reads
        return SimpleNamespace(
            stage_one=StageOneTotals(inputs=inputs), event_time=WatermarkState(watermark=6_000)
        )

    same = result(4)
    assert agreed_stage_one("pipeline 'p' batch 3", [same, same])[0] == StageOneTotals(inputs=4)

    other = result(5)
    with pytest.raises(BatchError, match=r"pipeline 'p' batch 3: .* nothing was committed"):
        agreed_stage_one("pipeline 'p' batch 3", [same, other])


def test_instances_that_saw_the_same_counts_of_different_elements_commit_nothing() -> None:
    """A re-run stage-1 task whose enrichment finished other elements by its deadline:
    offset 7 done and 9 pending in one run, the other way round in the re-run. The counts
    agree; the offsets do not, and the batch commits nothing rather than emit 7 twice or
    lose 9."""
    from microbatch.runtime.envelope import PartitionStats, stage_one_totals

    def result(done: int, pending: int) -> SimpleNamespace:
        stats = PartitionStats(2, 1, 0, 1, None, offset_sums=(done, 0, pending))
        return SimpleNamespace(
            stage_one=stage_one_totals([("t", 0, stats)]), event_time=WatermarkState()
        )

    with pytest.raises(BatchError, match="saw different stage-1 results"):
        agreed_stage_one("pipeline 'p' batch 3", [result(7, 9), result(9, 7)])


def test_records_are_sorted_by_key_bytes_then_source_order() -> None:
    out = EnvelopeBuilder()
    rows = [("t2", 0, 5, b"sb"), ("t1", 1, 9, b"sa"), ("t1", 0, 7, b"sb"), ("t1", 0, 3, b"sb"),
            ("t2", 0, 1, b"i\x01"), ("t1", 1, 2, b"sa")]  # fmt: skip
    for topic, part, off, key in rows:
        out.record(topic, part, off, 0, 0, 0, key, None, b"{}")
    out.dead("t1", 0, 4, 2, "undecodable", "bad", None, b"x")
    table = pa.Table.from_batches([out.build(Counter(), parallelism=2)], schema=ENVELOPE_SCHEMA)

    got = SortedRecords(table).select(["key", "topic", "partition", "offset"]).to_pylist()

    expected = table.filter(pc.equal(table.column("kind"), "record")).sort_by(
        [(c, "ascending") for c in ("key", "topic", "partition", "offset", "seq")]
    )
    assert got == expected.select(["key", "topic", "partition", "offset"]).to_pylist()
    assert [r["offset"] for r in got] == [1, 2, 9, 3, 7, 5]


def test_a_retried_or_speculative_task_writes_under_names_of_its_own(monkeypatch) -> None:
    import pyspark

    from microbatch.runtime.stage_two import with_task_attempt

    assert with_task_attempt("ab12") == "ab12"  # no Spark task: the driver's attempt
    for number, names in ((0, "ab12"), (1, "ab12t1"), (3, "ab12t3")):
        task = SimpleNamespace(attemptNumber=lambda n=number: n)
        monkeypatch.setattr(pyspark.TaskContext, "get", staticmethod(lambda t=task: t))
        assert with_task_attempt("ab12") == names


def test_rows_are_put_in_source_order_and_not_copied_when_they_already_are() -> None:
    from microbatch.runtime.sorted_records import in_source_order

    rows = pa.table(
        {
            "topic": ["b", "a", "a", "a"],
            "partition": [0, 1, 0, 0],
            "offset": [5, 2, 9, 9],
            "seq": [0, 0, 1, 0],
            "value": ["b0-5", "a1-2", "a0-9/1", "a0-9/0"],
        }
    )
    ordered = in_source_order(rows)
    assert ordered.column("value").to_pylist() == ["a0-9/0", "a0-9/1", "a1-2", "b0-5"]
    assert in_source_order(ordered) is ordered
    assert in_source_order(rows.slice(0, 0)).num_rows == 0


def test_a_window_over_payloads_whose_records_all_lack_its_field_sums_to_null(tmp_path) -> None:
    """Stage 2 built a window's columns from every field its records had: an instance
    none of whose records had the summed field failed every retry of its batch (``No
    match for FieldRef.Name(amount)``). It builds the fields the window reads."""
    from microbatch import windows
    from microbatch.dataflow import Dataflow
    from microbatch.keygroups import encode_key, key_group_of_bytes
    from microbatch.runtime.envelope import decode_payloads, encode_payload

    flow = Dataflow("w", checkpoints=str(tmp_path), event_time=EventTime("ts"), max_parallelism=16)
    source = flow.source(KafkaSource(topics=("t",))).map(lambda r: r)  # records as payloads
    sums = windows.tumbling("1m").sum("amount").final()
    source.key_by("user").window(sums, uid="sums").key_by("key").process(Noop(), uid="after")
    pipeline = flow.build()
    stage = StageTwo(pipeline, Settings.from_env(), 0, 1, None, None, 1_000_000)
    out = EnvelopeBuilder()
    for off, (user, ts) in enumerate([("a", 1_000), ("a", 2_000), ("b", 200_000)]):
        key, record = encode_key(user), {"user": user, "ts": ts}  # no "amount"
        kg = key_group_of_bytes(key, 16)
        out.record("t", 0, off, 0, 0, kg, key, ts, encode_payload(record))
    table = pa.Table.from_batches([out.build(Counter({("t", 0): 3}), parallelism=1)])

    result, router = stage.run_step(0, table)

    assert result.counters["windows_emitted"] == 1, result.counters
    rows = decode_payloads(router.record_rows().column("payload").to_pylist())
    assert rows == [{"key": "a", "window_start": 0, "window_end": 60_000, "sum_amount": None}]


class BrokenBatch(KeyedProcessFunction):
    """A function whose own ``process_batch`` has a bug."""

    def process_batch(self, batch):
        raise KeyError("oops")

    def process(self, key, records, ctx) -> None:
        pass


def test_a_process_batch_that_raises_fails_the_batch_naming_where(tmp_path) -> None:
    from microbatch.errors import ProcessError
    from microbatch.keygroups import encode_key, key_group_of_bytes

    pipe = Pipeline(
        name="p", source=KafkaSource(topics=("t",)), key_by="user", process=BrokenBatch(),
        checkpoints=str(tmp_path), max_parallelism=16, parallelism=1,
    )  # fmt: skip
    stage = StageTwo(pipe, Settings.from_env(), 7, 1, None, None, 1_000_000)
    out = EnvelopeBuilder()
    for off, user in enumerate(["a", "b"]):
        key = encode_key(user)
        value = json.dumps({"user": user}).encode()  # the Kafka value, as stage 1 keeps it
        out.record("t", 0, off, 0, 0, key_group_of_bytes(key, 16), key, None, value)
    table = pa.Table.from_batches([out.build(Counter({("t", 0): 2}), parallelism=1)])

    with pytest.raises(ProcessError) as failed:
        stage.run_step(0, table)

    assert str(failed.value).startswith(
        "pipeline 'p' batch 7 instance 0: process_batch() of BrokenBatch raised over 2 keys: "
        "KeyError: 'oops'"
    ), failed.value
