"""Batch planning rules against an in-memory broker, and plan storage / replay."""

from __future__ import annotations

import json
from collections.abc import Collection

import pytest

from microbatch.errors import SourceError
from microbatch.kafka import (
    BatchLimits,
    BatchPlan,
    BrokerView,
    OffsetRange,
    PlanStore,
    StartingPosition,
    TopicPartition,
    plan_batch,
    snapshot_from_json,
    snapshot_to_json,
)
from microbatch.storage import LocalFileStore

TP = TopicPartition
EARLIEST = StartingPosition.earliest()
NO_LIMITS = BatchLimits()


class FakeBroker:
    """Partitions as lists of record timestamps, offsets from a movable log start."""

    bootstrap_servers = "fake-1:9092,fake-2:9092"

    def __init__(self) -> None:
        self.logs: dict[TopicPartition, list[int]] = {}  # timestamp per offset
        self.log_start: dict[TopicPartition, int] = {}

    def add(self, topic: str, partition: int, timestamps: list[int], log_start: int = 0) -> None:
        self.logs[TP(topic, partition)] = list(timestamps)
        self.log_start[TP(topic, partition)] = log_start

    def partitions_for(self, topic: str) -> set[int] | None:
        found = {tp.partition for tp in self.logs if tp.topic == topic}
        return found or None

    def beginning_offsets(self, tps: Collection[TopicPartition]) -> dict[TopicPartition, int]:
        return {tp: self.log_start[tp] for tp in tps}

    def end_offsets(self, tps: Collection[TopicPartition]) -> dict[TopicPartition, int]:
        return {tp: len(self.logs[tp]) for tp in tps}

    def offsets_for_times(
        self, tps: Collection[TopicPartition], timestamp_ms: int
    ) -> dict[TopicPartition, int | None]:
        out: dict[TopicPartition, int | None] = {}
        for tp in tps:
            hits = [
                o
                for o, ts in enumerate(self.logs[tp])
                if o >= self.log_start[tp] and ts >= timestamp_ms
            ]
            out[tp] = hits[0] if hits else None
        return out


def plan(view: FakeBroker, committed=None, **kwargs) -> BatchPlan:
    options = {
        "pipeline": "clicks",
        "batch_id": 0 if committed is None else 1,
        "topics": ["a"],
        "committed": committed,
        "starting": EARLIEST,
        "limits": NO_LIMITS,
        "now_ms": 1_000,
    }
    options.update(kwargs)
    return plan_batch(view, **options)


@pytest.fixture
def broker() -> FakeBroker:
    b = FakeBroker()
    b.add("a", 0, list(range(100, 110)))  # 10 records, ts 100..109
    b.add("a", 1, list(range(200, 205)))  # 5 records, ts 200..204
    b.add("a", 2, [])  # empty
    return b


def test_fake_broker_is_a_broker_view(broker):
    assert isinstance(broker, BrokerView)


def test_first_batch_earliest_reads_everything_and_snapshots_every_partition(broker):
    p = plan(broker)
    assert p.ranges == (OffsetRange("a", 0, 0, 10), OffsetRange("a", 1, 0, 5))
    assert p.records == 15
    assert p.end_offsets() == {TP("a", 0): 10, TP("a", 1): 5, TP("a", 2): 0}
    assert p.new_partitions == ()  # the first batch has no "new since last checkpoint"


def test_first_batch_latest_reads_nothing_and_snapshots_the_ends(broker):
    p = plan(broker, starting=StartingPosition.latest())
    assert p.ranges == ()
    assert p.end_offsets() == {TP("a", 0): 10, TP("a", 1): 5, TP("a", 2): 0}


def test_first_batch_timestamp_starts_at_first_record_at_or_after_it(broker):
    p = plan(broker, starting=StartingPosition.timestamp(107))
    # a[0]: ts 107 is offset 7; a[1]: every record is later → 0; a[2]: empty → its end
    assert p.start_offsets == {TP("a", 0): 7, TP("a", 1): 0, TP("a", 2): 0}
    p = plan(broker, starting=StartingPosition.timestamp(10_000))  # nothing that late
    assert p.ranges == () and p.end_offsets() == {TP("a", 0): 10, TP("a", 1): 5, TP("a", 2): 0}


def test_committed_partitions_resume_and_unread_ones_keep_their_offset(broker):
    p = plan(broker, committed={TP("a", 0): 4, TP("a", 1): 5, TP("a", 2): 0})
    assert p.ranges == (OffsetRange("a", 0, 4, 10),)
    assert p.end_offsets() == {TP("a", 0): 10, TP("a", 1): 5, TP("a", 2): 0}


def test_new_partition_after_checkpoint_starts_from_earliest_even_if_starting_latest(broker):
    broker.add("a", 3, [300, 301, 302], log_start=1)
    committed = {TP("a", 0): 10, TP("a", 1): 5, TP("a", 2): 0}
    p = plan(broker, committed=committed, starting=StartingPosition.latest())
    assert p.new_partitions == (TP("a", 3),)
    assert p.ranges == (OffsetRange("a", 3, 1, 3),)
    assert p.end_offsets()[TP("a", 3)] == 3


def test_new_partition_after_checkpoint_uses_starting_timestamp_when_configured(broker):
    broker.add("a", 3, [300, 301, 302])
    committed = {TP("a", 0): 10, TP("a", 1): 5, TP("a", 2): 0}
    p = plan(broker, committed=committed, starting=StartingPosition.timestamp(302))
    assert p.ranges == (OffsetRange("a", 3, 2, 3),)


def test_new_topic_partitions_all_new_and_other_committed_topics_carried(broker):
    broker.add("b", 0, [1, 2])
    committed = {TP("a", 0): 10, TP("a", 1): 5, TP("a", 2): 0, TP("old", 0): 77}
    p = plan(broker, committed=committed, topics=["a", "b"])
    assert p.new_partitions == (TP("b", 0),)
    assert p.ranges == (OffsetRange("b", 0, 0, 2),)
    assert p.end_offsets()[TP("old", 0)] == 77  # topic no longer read: carried unchanged


def test_empty_partition_has_no_range_but_stays_in_snapshot(broker):
    p = plan(broker, topics=["a"])
    assert TP("a", 2) not in {r.tp for r in p.ranges}
    assert p.end_offsets()[TP("a", 2)] == 0


def test_max_records_per_partition_caps_each_partition(broker):
    p = plan(broker, limits=BatchLimits(max_records_per_partition=3))
    assert p.ranges == (OffsetRange("a", 0, 0, 3), OffsetRange("a", 1, 0, 3))
    p2 = plan(broker, committed=p.end_offsets(), limits=BatchLimits(max_records_per_partition=3))
    assert p2.ranges == (OffsetRange("a", 0, 3, 6), OffsetRange("a", 1, 3, 5))


def test_max_records_total_is_shared_in_proportion_to_backlog(broker):
    p = plan(broker, limits=BatchLimits(max_records_total=6))
    # backlogs 10 and 5 → 4 and 2
    assert p.ranges == (OffsetRange("a", 0, 0, 4), OffsetRange("a", 1, 0, 2))
    assert p.records == 6


def test_max_records_total_remainder_is_deterministic_and_exact():
    limits = BatchLimits(max_records_total=10)
    backlog = {TP("t", p): 7 for p in range(4)}  # 28 offsets, 10 allowed → 2.5 each
    got = limits.apply(backlog)
    assert sum(got.values()) == 10
    assert got == {TP("t", 0): 3, TP("t", 1): 3, TP("t", 2): 2, TP("t", 3): 2}
    assert limits.apply(dict(reversed(backlog.items()))) == got


def test_limits_combine_per_partition_then_total():
    limits = BatchLimits(max_records_per_partition=4, max_records_total=6)
    got = limits.apply({TP("t", 0): 100, TP("t", 1): 2, TP("t", 2): 0})
    assert got == {TP("t", 0): 4, TP("t", 1): 2, TP("t", 2): 0}
    got = BatchLimits(max_records_per_partition=5, max_records_total=6).apply(
        {TP("t", 0): 100, TP("t", 1): 100}
    )
    assert got == {TP("t", 0): 3, TP("t", 1): 3}


@pytest.mark.parametrize("bad", [0, -5, 1.5])
def test_batch_limits_reject_non_positive(bad):
    with pytest.raises(SourceError, match="max_records_total must be ≥ 1"):
        BatchLimits(max_records_total=bad)


def test_until_timestamp_stops_before_first_record_at_or_after_it(broker):
    p = plan(broker, until_timestamp_ms=103)
    assert p.ranges == (OffsetRange("a", 0, 0, 3),)  # ts 100,101,102; a[1] starts at 200
    assert p.until_timestamp_ms == 103
    assert p.reaches_until is True  # a backfill may start where this batch ends
    assert plan(broker).reaches_until is None  # no interval end, nothing to reach


def test_until_timestamp_with_no_later_record_reads_to_the_end(broker):
    p = plan(broker, until_timestamp_ms=10_000)
    assert p.ranges == (OffsetRange("a", 0, 0, 10), OffsetRange("a", 1, 0, 5))


def test_until_timestamp_before_committed_offset_reads_nothing(broker):
    p = plan(
        broker, committed={TP("a", 0): 8, TP("a", 1): 0, TP("a", 2): 0}, until_timestamp_ms=102
    )
    assert p.ranges == ()
    assert p.end_offsets()[TP("a", 0)] == 8  # never goes backwards
    assert p.reaches_until is False  # it stands past its end: no backfill starts here


def test_until_timestamp_then_limits(broker):
    p = plan(broker, until_timestamp_ms=108, limits=BatchLimits(max_records_per_partition=5))
    assert p.ranges == (OffsetRange("a", 0, 0, 5),)
    assert p.reaches_until is False  # capped before its end
    assert type(p).from_json(p.to_json()) == p


def test_retention_out_of_range_fails_naming_everything(broker):
    broker.log_start[TP("a", 0)] = 6
    with pytest.raises(SourceError) as err:
        plan(broker, committed={TP("a", 0): 2, TP("a", 1): 0, TP("a", 2): 0})
    message = str(err.value)
    for part in (
        "a[0]",
        "offset 2",
        "earliest available offset is 6",
        FakeBroker.bootstrap_servers,
    ):
        assert part in message
    assert 'on_out_of_range="earliest"' in message


def test_retention_out_of_range_earliest_skips_and_records_count(broker):
    broker.log_start[TP("a", 0)] = 6
    committed = {TP("a", 0): 2, TP("a", 1): 0, TP("a", 2): 0}
    p = plan(broker, committed=committed, on_out_of_range="earliest")
    assert p.skipped == {TP("a", 0): 4}
    assert p.ranges[0] == OffsetRange("a", 0, 6, 10)


def test_committed_beyond_end_fails(broker):
    with pytest.raises(SourceError, match=r"a\[1\]: committed offset 9 is beyond the end offset 5"):
        plan(broker, committed={TP("a", 0): 0, TP("a", 1): 9, TP("a", 2): 0})


def test_disappeared_partition_fails(broker):
    with pytest.raises(SourceError, match=r"no longer has partition\(s\) \[7\]"):
        plan(broker, committed={TP("a", 0): 0, TP("a", 7): 3})


def test_missing_topic_fails_naming_bootstrap_servers(broker):
    with pytest.raises(SourceError, match="topic 'nope' does not exist on fake-1:9092"):
        plan(broker, topics=["nope"])


def test_unknown_on_out_of_range_value_fails(broker):
    with pytest.raises(SourceError, match="on_out_of_range='skip'"):
        plan(broker, on_out_of_range="skip")


def test_plan_json_round_trip(broker):
    broker.log_start[TP("a", 0)] = 1
    broker.add("a", 3, [5, 6])
    committed = {TP("a", 0): 0, TP("a", 1): 2, TP("a", 2): 0}
    p = plan(
        broker,
        committed=committed,
        on_out_of_range="earliest",
        until_timestamp_ms=203,
        limits=BatchLimits(max_records_per_partition=4),
    )
    assert p.skipped and p.new_partitions and p.ranges
    back = BatchPlan.from_json(json.loads(json.dumps(p.to_json())))
    assert back == p
    assert back.end_offsets() == p.end_offsets()


def test_plan_end_offsets_survive_manifest_metadata_json(broker):
    p = plan(broker)
    stored = json.loads(json.dumps({"offsets": snapshot_to_json(p.end_offsets())}))
    assert snapshot_from_json(stored["offsets"]) == p.end_offsets()


def test_plan_rejects_range_not_starting_at_start_offset():
    with pytest.raises(SourceError, match="does not begin at the partition's start offset 0"):
        BatchPlan("p", 0, {TP("t", 0): 0}, (OffsetRange("t", 0, 3, 5),))


def test_ranges_for_task_partition_the_plan(broker):
    broker.add("a", 3, [1])
    p = plan(broker)
    for n in (1, 2, 3, 5):
        parts = [r for task in range(n) for r in p.ranges_for_task(task, n)]
        assert sorted(parts) == list(p.ranges)


@pytest.mark.parametrize(
    "position",
    [StartingPosition.earliest(), StartingPosition.latest(), StartingPosition.timestamp(5)],
)
def test_starting_position_json_round_trip(position):
    assert StartingPosition.from_json(json.loads(json.dumps(position.to_json()))) == position


@pytest.mark.parametrize(("kind", "ts"), [("timestamp", None), ("latest", 5), ("soon", None)])
def test_starting_position_invalid_combinations_fail(kind, ts):
    with pytest.raises(SourceError):
        StartingPosition(kind, ts)


def test_plan_store_save_is_exclusive_and_returns_existing_plan(tmp_path, broker):
    store = PlanStore(LocalFileStore(tmp_path), "pipelines/clicks")
    first = plan(broker)
    assert store.save(first) == first
    assert store.key(0) == "pipelines/clicks/plans/00000000000000000000.json"
    broker.logs[TP("a", 0)] += [110, 111]  # more data arrived before the retry
    second = plan(broker, now_ms=2_000)
    assert second != first
    assert store.save(second) == first  # crash replay: the first plan wins
    assert store.load(0) == first
    assert store.load(1) is None


def test_plan_or_replay_replays_then_plans_the_next_batch(tmp_path, broker):
    store = PlanStore(LocalFileStore(tmp_path), "p/")
    options = {
        "pipeline": "clicks",
        "topics": ["a"],
        "starting": EARLIEST,
        "limits": BatchLimits(max_records_per_partition=4),
    }
    p0 = store.plan_or_replay(broker, committed=None, committed_batch_id=None, **options)
    broker.logs[TP("a", 0)] += [110]
    again = store.plan_or_replay(broker, committed=None, committed_batch_id=None, **options)
    assert again == p0 and p0.batch_id == 0
    p1 = store.plan_or_replay(broker, committed=p0.end_offsets(), committed_batch_id=0, **options)
    assert p1.batch_id == 1
    assert p1.start_offsets == p0.end_offsets()


def test_plan_or_replay_rejects_plan_from_a_different_history(tmp_path, broker):
    store = PlanStore(LocalFileStore(tmp_path), "p/")
    options = {"pipeline": "clicks", "topics": ["a"], "starting": EARLIEST, "limits": NO_LIMITS}
    store.plan_or_replay(broker, committed={TP("a", 0): 1}, committed_batch_id=4, **options)
    with pytest.raises(
        SourceError, match=r"starts a\[0\] at 1, but the committed checkpoint is at 3"
    ):
        store.plan_or_replay(broker, committed={TP("a", 0): 3}, committed_batch_id=4, **options)


def test_plan_store_other_pipeline_on_same_prefix_fails(tmp_path, broker):
    store = PlanStore(LocalFileStore(tmp_path), "shared/")
    store.save(plan(broker))
    with pytest.raises(SourceError, match="belongs to pipeline 'clicks', not 'orders'"):
        store.save(plan(broker, pipeline="orders"))


def test_an_unreachable_cluster_fails_within_the_views_timeout_naming_it(monkeypatch):
    from kafka.net.manager import KafkaConnectionManager

    from microbatch.kafka import KafkaBrokerView

    # What kafka-python's wait for its first broker was given: the view's timeout, not
    # kafka-python's own 30 s default (bootstrap_timeout_ms).
    waits_ms: list[int | None] = []
    bootstrap = KafkaConnectionManager.bootstrap

    def recorded_bootstrap(self, timeout_ms=None, refresh=True):
        waits_ms.append(timeout_ms)
        return bootstrap(self, timeout_ms, refresh)

    monkeypatch.setattr(KafkaConnectionManager, "bootstrap", recorded_bootstrap)

    with pytest.raises(SourceError, match=r"cannot connect to Kafka at 127\.0\.0\.1:1"):
        KafkaBrokerView("127.0.0.1:1", timeout_s=1.0)

    assert waits_ms == [1000]
