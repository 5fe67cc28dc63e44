"""The Kafka source on a real broker: plan, read in Spark, rescale, replay, retention, lag.

Every test uses its own topic (uuid) so tests never see each other's records. The
reference for "what a batch must return" is always a plain ``read_committed`` kafka-python
consumer reading the same offsets, plus the values the test knows it committed.
"""

from __future__ import annotations

import functools
import json
import uuid
from collections.abc import Mapping

import pytest

from microbatch.errors import SourceError
from microbatch.kafka import (
    BatchLimits,
    KafkaBrokerView,
    OffsetRange,
    PlanStore,
    StartingPosition,
    TopicPartition,
    consumer_group_name,
    mirror_offsets,
    partition_lag,
    plan_batch,
    read_range,
    read_range_confluent,
    read_range_native,
    read_ranges,
    snapshot_from_json,
    snapshot_to_json,
)
from microbatch.kafka.planner import METADATA_BACKOFF_MS
from microbatch.storage import LocalFileStore

pytestmark = pytest.mark.integration

Row = tuple[int, int, bytes | None, bytes, tuple[tuple[str, bytes], ...]]


def new_topic(admin, partitions: int, **configs: str) -> str:
    name = f"src-{uuid.uuid4().hex[:12]}"
    spec = {"num_partitions": partitions, "replication_factor": 1, "configs": configs}
    admin.create_topics({name: spec}, wait_for_metadata=True)
    return name


def produce(
    bootstrap: str,
    topic: str,
    records: list[tuple[int, bytes | None, bytes]],
    *,
    transaction: str | None = None,
    headers: list[tuple[str, bytes]] | None = None,
) -> None:
    """Send ``(partition, key, value)``; ``transaction`` is ``"commit"`` or ``"abort"``."""
    from kafka import KafkaProducer

    options = {"transactional_id": f"tx-{uuid.uuid4().hex}"} if transaction else {}
    producer = KafkaProducer(bootstrap_servers=bootstrap, acks="all", linger_ms=5, **options)
    try:
        if transaction:
            producer.init_transactions()
            producer.begin_transaction()
        futures = [
            producer.send(topic, key=k, value=v, partition=p, headers=headers or [])
            for p, k, v in records
        ]
        producer.flush()
        assert all(f.succeeded() for f in futures)
        if transaction == "commit":
            producer.commit_transaction()
        elif transaction == "abort":
            producer.abort_transaction()
    finally:
        producer.close()


def reference_read(bootstrap: str, until: Mapping[TopicPartition, int]) -> list[Row]:
    """What a plain read_committed consumer sees below ``until``, sorted."""
    from kafka import KafkaConsumer
    from kafka import TopicPartition as KTP

    consumer = KafkaConsumer(
        bootstrap_servers=bootstrap, enable_auto_commit=False, isolation_level="read_committed"
    )
    rows: list[Row] = []
    try:
        tps = [KTP(tp.topic, tp.partition) for tp, end in until.items() if end > 0]
        consumer.assign(tps)
        consumer.seek_to_beginning(*tps)
        for _ in range(200):
            if all(consumer.position(tp) >= until[TopicPartition(*tp)] for tp in tps):
                break
            for tp, records in consumer.poll(timeout_ms=200).items():
                end = until[TopicPartition(*tp)]
                rows += [
                    (r.partition, r.offset, r.key, r.value, tuple(r.headers))
                    for r in records
                    if r.offset < end
                ]
        else:
            raise AssertionError(f"reference consumer did not reach {until}")
    finally:
        consumer.close(autocommit=False)
    return sorted(rows)


def spark_rows(df) -> list[Row]:
    return sorted(
        (r.partition, r.offset, r.key, r.value, tuple((h.key, h.value) for h in r.headers))
        for r in df.collect()
    )


def read_at_parallelism(spark, bootstrap: str, plan, parallelism: int, **kwargs) -> list[Row]:
    """Each source task reads its own partitions (Flink's assignment); one Spark job."""
    frames = [
        read_ranges(spark, bootstrap, plan.ranges_for_task(task, parallelism), **kwargs)
        for task in range(parallelism)
    ]
    return spark_rows(functools.reduce(lambda a, b: a.unionAll(b), frames))


def values(rows: list[Row]) -> list[bytes]:
    return sorted(r[3] for r in rows)


def test_rescale_add_partitions_replay_reads_every_committed_record_once(
    spark, bootstrap, admin, tmp_path
):
    topic = new_topic(admin, 4)
    produced: list[bytes] = []

    def batch(label: str, partitions: int, n: int) -> list[tuple[int, bytes, bytes]]:
        return [(i % partitions, f"k{i % 7}".encode(), f"{label}-{i}".encode()) for i in range(n)]

    first = batch("plain", 4, 400)
    produce(bootstrap, topic, first, headers=[("source", b"test"), ("empty", b"")])
    produce(bootstrap, topic, batch("txn-ok", 4, 40), transaction="commit")
    produce(bootstrap, topic, batch("aborted", 4, 40), transaction="abort")
    produce(bootstrap, topic, batch("after-abort", 4, 40))
    produce(bootstrap, topic, batch("txn-tail", 4, 20), transaction="commit")  # tail = markers
    produced += [v for _, _, v in first]
    produced += [f"{label}-{i}".encode() for label, n in [("txn-ok", 40), ("after-abort", 40)]
                 for i in range(n)]  # fmt: skip
    produced += [f"txn-tail-{i}".encode() for i in range(20)]

    plans = PlanStore(LocalFileStore(tmp_path / "store"), f"pipelines/{topic}/")
    options = {
        "pipeline": topic,
        "topics": [topic],
        "starting": StartingPosition.earliest(),
        "limits": BatchLimits(),
    }
    with KafkaBrokerView(bootstrap) as view:
        plan0 = plans.plan_or_replay(view, committed=None, committed_batch_id=None, **options)
    assert plan0.batch_id == 0 and len(plan0.ranges) == 4
    rows0 = read_at_parallelism(spark, bootstrap, plan0, 2, max_records_per_task=90)

    # The offsets travel through the manifest's metadata as JSON.
    metadata = json.loads(json.dumps({"offsets": snapshot_to_json(plan0.end_offsets())}))
    committed = snapshot_from_json(metadata["offsets"])

    admin.create_partitions({topic: 6})
    second = batch("more", 6, 120)
    produce(bootstrap, topic, second)
    produce(bootstrap, topic, batch("aborted-2", 6, 30), transaction="abort")
    produce(bootstrap, topic, batch("txn-2", 6, 30), transaction="commit")
    produced += [v for _, _, v in second] + [f"txn-2-{i}".encode() for i in range(30)]

    with KafkaBrokerView(bootstrap) as view:
        plan1 = plans.plan_or_replay(view, committed=committed, committed_batch_id=0, **options)
    assert plan1.new_partitions == (TopicPartition(topic, 4), TopicPartition(topic, 5))
    assert plan1.start_offsets[TopicPartition(topic, 4)] == 0  # new partitions: earliest
    assert {r.start for r in plan1.ranges if r.partition < 4} == {
        committed[TopicPartition(topic, p)] for p in range(4)
    }
    rows1 = read_at_parallelism(spark, bootstrap, plan1, 3)

    # Exactly once, nothing aborted, and the same as a plain read_committed consumer.
    everything = sorted(rows0 + rows1)
    assert len({(r[0], r[1]) for r in everything}) == len(everything)
    assert values(everything) == sorted(produced)
    assert not [r for r in everything if r[3].startswith(b"aborted")]
    assert everything == reference_read(bootstrap, plan1.end_offsets())
    assert {r[4] for r in rows0 if r[3].startswith(b"plain")} == {
        (("source", b"test"), ("empty", b""))
    }

    # Crash replay: a retry after more data arrived gets the stored plan and the same rows.
    produce(bootstrap, topic, batch("late", 6, 12))
    with KafkaBrokerView(bootstrap) as view:
        replayed = plans.plan_or_replay(view, committed=committed, committed_batch_id=0, **options)
    assert replayed == plan1
    again = sorted(
        (row["partition"], row["offset"], row["key"], row["value"], tuple(
            (h["key"], h["value"]) for h in row["headers"]))
        for r in replayed.ranges
        for b in read_range(bootstrap, r, batch_rows=50)
        for row in b.to_pylist()
    )  # fmt: skip
    assert again == rows1


def test_compacted_topic_reads_what_a_committed_consumer_sees(spark, bootstrap, admin):
    topic = new_topic(
        admin,
        2,
        **{
            "cleanup.policy": "compact",
            "segment.ms": "100",
            "min.cleanable.dirty.ratio": "0.01",
            "delete.retention.ms": "100",
            "min.compaction.lag.ms": "0",
        },
    )
    latest: dict[tuple[int, bytes], bytes] = {}
    for burst in range(4):
        records = [(i % 2, f"key-{i % 10}".encode(), f"v{burst}-{i}".encode()) for i in range(60)]
        produce(bootstrap, topic, records)
        latest.update({(p, k): v for p, k, v in records})

    with KafkaBrokerView(bootstrap) as view:
        plan = plan_batch(
            view,
            pipeline="compacted",
            batch_id=0,
            topics=[topic],
            committed=None,
            starting=StartingPosition.earliest(),
            limits=BatchLimits(),
        )
    before = reference_read(bootstrap, plan.end_offsets())
    rows = read_at_parallelism(spark, bootstrap, plan, 1, max_records_per_task=50)
    after = reference_read(bootstrap, plan.end_offsets())

    # Compaction only removes records, and may run at any moment: after ⊆ ours ⊆ before.
    assert set(after) <= set(rows) <= set(before)
    assert len({(r[0], r[1]) for r in rows}) == len(rows)
    assert {(r[0], r[2]): r[3] for r in rows} == latest  # the newest value per key survives


def test_tail_of_transaction_markers_and_aborted_records_does_not_hang(bootstrap, admin):
    topic = new_topic(admin, 1)
    produce(bootstrap, topic, [(0, None, f"a{i}".encode()) for i in range(5)])
    produce(bootstrap, topic, [(0, None, f"c{i}".encode()) for i in range(5)], transaction="commit")
    produce(bootstrap, topic, [(0, None, f"x{i}".encode()) for i in range(5)], transaction="abort")
    with KafkaBrokerView(bootstrap) as view:
        end = view.end_offsets([TopicPartition(topic, 0)])[TopicPartition(topic, 0)]
    assert end == 17  # 15 records + 2 control markers
    batches = list(read_range(bootstrap, OffsetRange(topic, 0, 0, end), poll_timeout_s=5))
    got = [v for b in batches for v in b.column("value").to_pylist()]
    assert got == [f"a{i}".encode() for i in range(5)] + [f"c{i}".encode() for i in range(5)]
    # A range in the middle of the gap (only a marker and aborted records) is empty.
    assert list(read_range(bootstrap, OffsetRange(topic, 0, 10, end), poll_timeout_s=5)) == []


@pytest.mark.parametrize(
    "read",
    [read_range, read_range_confluent, read_range_native],
    ids=["python", "confluent", "native"],
)
def test_read_range_past_the_end_times_out_with_a_named_error(bootstrap, admin, read):
    topic = new_topic(admin, 1)
    produce(bootstrap, topic, [(0, None, b"x")] * 3)
    with pytest.raises(SourceError) as err:
        list(read(bootstrap, OffsetRange(topic, 0, 0, 50), poll_timeout_s=1))
    message = str(err.value)
    assert f"{topic}[0] [0, 50) on {bootstrap}" in message
    assert "no progress for 1 s at offset 3" in message


def test_deleted_records_fail_the_plan_and_the_read_or_skip_when_asked(bootstrap, admin):
    from kafka import TopicPartition as KTP

    topic = new_topic(admin, 1)
    produce(bootstrap, topic, [(0, None, f"{i}".encode()) for i in range(100)])
    admin.delete_records({KTP(topic, 0): 50})
    tp = TopicPartition(topic, 0)
    options = {
        "pipeline": "retention",
        "batch_id": 3,
        "topics": [topic],
        "committed": {tp: 10},
        "starting": StartingPosition.earliest(),
        "limits": BatchLimits(),
    }
    with KafkaBrokerView(bootstrap) as view:
        with pytest.raises(SourceError) as err:
            plan_batch(view, **options)
        skipping = plan_batch(view, on_out_of_range="earliest", **options)
    message = str(err.value)
    for part in (f"{topic}[0]", "offset 10", "offset is 50", bootstrap, "on_out_of_range"):
        assert part in message
    assert skipping.skipped == {tp: 40}
    assert skipping.ranges == (OffsetRange(topic, 0, 50, 100),)

    with pytest.raises(SourceError, match="offset 10 is no longer available"):
        list(read_range(bootstrap, OffsetRange(topic, 0, 10, 100), poll_timeout_s=10))


def test_missing_topic_plans_to_a_named_error(bootstrap):
    with KafkaBrokerView(bootstrap) as view, pytest.raises(SourceError, match=bootstrap):
        plan_batch(
            view,
            pipeline="p",
            batch_id=0,
            topics=[f"absent-{uuid.uuid4().hex[:8]}"],
            committed=None,
            starting=StartingPosition.earliest(),
            limits=BatchLimits(),
        )


def test_mirror_offsets_shows_up_in_the_consumer_group(bootstrap, admin):
    from kafka import TopicPartition as KTP

    topic = new_topic(admin, 2)
    produce(bootstrap, topic, [(i % 2, None, b"v") for i in range(20)])
    group = consumer_group_name(f"pipe-{uuid.uuid4().hex[:8]}")
    snapshot = {TopicPartition(topic, 0): 4, TopicPartition(topic, 1): 10}
    mirror_offsets(bootstrap, group, snapshot)

    listed = admin.list_group_offsets({group: None})[group]
    assert {(tp.topic, tp.partition): om.offset for tp, om in listed.items()} == {
        (topic, 0): 4,
        (topic, 1): 10,
    }
    with KafkaBrokerView(bootstrap) as view:
        ends = view.end_offsets(list(snapshot))
    assert partition_lag(ends, snapshot) == {
        TopicPartition(topic, 0): 6,
        TopicPartition(topic, 1): 0,
    }
    mirror_offsets(bootstrap, group, {TopicPartition(topic, 0): 10})  # moves on next batch
    listed = admin.list_group_offsets({group: None})[group]
    assert listed[KTP(topic, 0)].offset == 10


def test_a_plan_asks_for_the_topics_without_kafka_pythons_100_ms_metadata_backoff(bootstrap, admin):
    """kafka-python 3.0 ignores the consumer's ``retry_backoff_ms`` for cluster metadata,
    so a view's first question waited 100 ms after bootstrap; the view shortens it where
    kafka-python keeps it. This fails when an upgrade moves it (then drop or move the
    workaround: ``planner._quick_metadata``)."""
    topic = new_topic(admin, 2)
    with KafkaBrokerView(bootstrap) as view:
        assert view._consumer._manager.cluster.config["retry_backoff_ms"] == METADATA_BACKOFF_MS
        assert view.partitions_for(topic) == {0, 1}
