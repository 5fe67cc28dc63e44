"""A dataflow without keyed steps in one Spark stage: how the batch's ranges are dealt to
the instances, and how the instances' shares of stage 1's totals add up to the batch's."""

from __future__ import annotations

from microbatch.kafka.offsets import OffsetRange
from microbatch.runtime import KeyedProcessFunction
from microbatch.runtime.envelope import PartitionStats, stage_one_totals
from microbatch.runtime.one_stage import deal_ranges, runs_in_one_stage
from microbatch.runtime.records import StageOneTotals


def _range(partition: int, count: int) -> OffsetRange:
    return OffsetRange("bids", partition, 100, 100 + count)


def test_ranges_are_dealt_largest_first_to_the_least_loaded_instance() -> None:
    ranges = [_range(0, 10), _range(1, 50), _range(2, 30), _range(3, 25), _range(4, 0)]
    dealt = deal_ranges(ranges, 2)
    assert [[r.partition for r in own] for own in dealt] == [[0, 1], [2, 3]]  # read in order
    assert [sum(r.count for r in own) for own in dealt] == [60, 55]
    assert deal_ranges(reversed(ranges), 2) == dealt  # the plan's order does not matter


def test_an_instance_without_ranges_still_gets_its_place() -> None:
    assert deal_ranges([_range(0, 5)], 3) == [[_range(0, 5)], [], []]
    assert deal_ranges([], 2) == [[], []]


def test_the_instances_shares_add_up_to_what_one_stage_two_would_have_counted() -> None:
    """Each instance counted the partitions it read (one partition split over two); the
    sum equals the totals stage 2 computes from every task's ``stat`` rows."""
    a0 = PartitionStats(10, 8, 2, 0, 5_000, (45, 10, 0))
    b1 = PartitionStats(7, 7, 0, 0, 9_000, (21, 0, 0))
    a0_rest = PartitionStats(4, 4, 0, 0, 6_000, (50, 0, 0))
    b2 = PartitionStats(3, 0, 3, 0, None, (0, 6, 0))
    shares = [
        stage_one_totals([("t", 0, a0), ("t", 1, b1)]),
        stage_one_totals([("t", 0, a0_rest), ("t", 2, b2)]),
    ]
    whole = stage_one_totals([("t", 0, a0), ("t", 1, b1), ("t", 0, a0_rest), ("t", 2, b2)])
    assert StageOneTotals.sum_of(shares) == whole
    assert whole.max_event == {"t/0": 6_000, "t/1": 9_000}
    assert StageOneTotals.sum_of([]) == StageOneTotals()


def test_only_a_dataflow_without_keyed_steps_read_in_its_tasks_runs_in_one_stage() -> None:
    from microbatch.dataflow import Dataflow
    from microbatch.runtime import KafkaSource, ParquetSink

    flow = Dataflow("etl", checkpoints="/tmp/unused", max_parallelism=8)
    flow.source(KafkaSource(topics=("bids",))).to(ParquetSink("out", "/tmp/unused-out"))
    sinks_only = flow.build()
    keyed = Dataflow("keyed", checkpoints="/tmp/unused", max_parallelism=8)
    keyed.source(KafkaSource(topics=("bids",))).key_by("auction").process(
        _Nothing(), uid="nothing"
    ).to(ParquetSink("out", "/tmp/unused-out"))
    assert runs_in_one_stage(sinks_only, "confluent", reissued=0)
    assert runs_in_one_stage(sinks_only, "python", reissued=0)
    assert not runs_in_one_stage(sinks_only, "spark", reissued=0)  # a task per range
    assert not runs_in_one_stage(sinks_only, "confluent", reissued=3)  # enrichment re-issued
    assert not runs_in_one_stage(keyed.build(), "confluent", reissued=0)


class _Nothing(KeyedProcessFunction):
    def process(self, key: object, records: object, ctx: object) -> None:
        pass
