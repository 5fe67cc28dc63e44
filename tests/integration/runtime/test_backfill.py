"""Backfill by data interval on real Kafka and Spark: rewind to the checkpoint as of the
first interval's start, replace each interval's output atomically, same files every time.

Records carry Kafka timestamps inside four 5-minute intervals I0..I3; batches are run with
each interval's start and end, as the Airflow operator does.
"""

from __future__ import annotations

import collections
import json
import uuid
from pathlib import Path

import pytest

from microbatch.checkpoint import Layout, list_checkpoints, load_manifest, read_key_state
from microbatch.errors import CheckpointError, ConfigError
from microbatch.runtime import BatchOptions, BatchRunner
from microbatch.sinks import parquet as ps
from microbatch.sinks import read_parquet_sink
from microbatch.storage import open_store
from tests.integration.runtime.pipelines import click, count_pipeline

pytestmark = pytest.mark.integration

T0 = 1_767_225_600_000  # 2026-01-01T00:00Z
STEP = 5 * 60_000
USERS = [f"u{i}" for i in range(5)]


def interval(i: int) -> tuple[int, int]:
    return T0 + i * STEP, T0 + (i + 1) * STEP


@pytest.fixture(scope="module")
def topic(admin, bootstrap) -> tuple[str, list[tuple[str, int]]]:
    """Two partitions, 12 clicks per interval; returns (topic, [(user, interval)])."""
    from kafka import KafkaProducer

    name = f"bf-{uuid.uuid4().hex[:10]}"
    # Keep the records: their 2026-01-01 timestamps are older than the default retention.
    spec = {"num_partitions": 2, "replication_factor": 1, "configs": {"retention.ms": "-1"}}
    admin.create_topics({name: spec}, wait_for_metadata=True)
    producer = KafkaProducer(bootstrap_servers=bootstrap, acks="all")
    sent = []
    for i in range(4):
        start, _ = interval(i)
        for n in range(12):
            user, ts = USERS[(n * 3 + i) % len(USERS)], start + n * 20_000
            value = click(user, f"/p{n}", ts)
            producer.send(name, key=user.encode(), value=value, partition=n % 2, timestamp_ms=ts)
            sent.append((user, i))
    producer.flush()
    producer.close()
    return name, sent


def run(spark, settings, pipe, i: int, *, backfill: bool = False, **kw):
    start, end = interval(i)
    options = BatchOptions(interval_start_ms=start, until_timestamp_ms=end, backfill=backfill,
                           run_id=f"i{i}-{uuid.uuid4().hex[:6]}", **kw)  # fmt: skip
    return BatchRunner(spark, pipe, settings).run(options)


def visible_files(root: Path) -> list[tuple[int, bytes]]:
    """(records read up to, file bytes) of every visible output file, in batch order."""
    store = open_store(str(root / "counts"))
    entries = ps.commit_entries(store)
    return [
        (sum(entries[b]["end_offsets"].values()), store.get(key))
        for b in ps.visible_batches(entries)
        for key in entries[b]["files"]
    ]


def state(pipe) -> dict[str, dict]:
    store = open_store(pipe.checkpoints)
    return {u: read_key_state(store, Layout(), u) for u in USERS}


def expected_rows(sent: list[tuple[str, int]]) -> list[dict]:
    """Plain Python: one row per user per interval with its clicks and running total."""
    rows, totals = [], collections.Counter()
    for i in range(4):
        per = collections.Counter(u for u, j in sent if j == i)
        for user in sorted(per):
            totals[user] += per[user]
            rows.append({"user": user, "clicks": per[user], "total": totals[user]})
    return sorted(rows, key=json.dumps)


def rows(root: Path) -> list[dict]:
    return sorted(read_parquet_sink(str(root / "counts")).to_pylist(), key=json.dumps)


def test_backfills_replace_each_interval_atomically_and_rewrite_the_same_files(
    spark, kafka_settings, topic, tmp_path: Path
) -> None:
    name, sent = topic
    pipe = count_pipeline(name, str(tmp_path))
    for i in range(4):
        assert run(spark, kafka_settings, pipe, i).records_in == 12
    assert rows(tmp_path) == expected_rows(sent)
    scheduled_files, scheduled_state = visible_files(tmp_path), state(pipe)

    outputs = []
    for _attempt in range(2):  # the same backfill twice: identical outputs
        first = run(spark, kafka_settings, pipe, 1, backfill=True)
        assert first.rewind is not None and first.rewind["to_checkpoint"] is not None
        assert first.records_in == 12
        # Mid-backfill a reader sees I1 recomputed and I2, I3 as before: each once.
        assert sum(r["clicks"] for r in rows(tmp_path)) == 48
        assert rows(tmp_path) == expected_rows(sent)
        for i in (2, 3):
            r = run(spark, kafka_settings, pipe, i, backfill=True)
            assert (r.rewind, r.records_in) == (None, 12)  # in order: no second rewind
        assert rows(tmp_path) == expected_rows(sent)
        assert state(pipe) == scheduled_state
        outputs.append(visible_files(tmp_path))
    assert outputs[0] == outputs[1] == scheduled_files  # same rows in the same file bytes

    # From the very first interval: back to before the first batch.
    first = run(spark, kafka_settings, pipe, 0, backfill=True)
    assert first.rewind == {"to_checkpoint": None, "undone": [0, first.batch_id - 2],
                            "checkpoint": first.batch_id - 1}  # fmt: skip
    for i in (1, 2, 3):
        run(spark, kafka_settings, pipe, i, backfill=True)
    assert visible_files(tmp_path) == scheduled_files
    assert state(pipe) == scheduled_state

    # The next scheduled interval simply continues.
    assert run(spark, kafka_settings, pipe, 4).records_in == 0


def test_backfills_that_cannot_be_exact_are_refused_before_anything_changes(
    spark, kafka_settings, topic, admin, tmp_path: Path
) -> None:
    from kafka import TopicPartition

    name, _ = topic
    pipe = count_pipeline(name, str(tmp_path))
    for i in range(3):
        run(spark, kafka_settings, pipe, i)
    store = open_store(pipe.checkpoints)
    before, files_before = list_checkpoints(store, Layout()), visible_files(tmp_path)

    odd = BatchOptions(interval_start_ms=T0 + 7 * 60_000, until_timestamp_ms=interval(2)[1],
                       backfill=True)  # fmt: skip
    with pytest.raises(CheckpointError, match="Retained checkpoints end at"):
        BatchRunner(spark, pipe, kafka_settings).run(odd)

    with_kafka = count_pipeline(name, str(tmp_path), out_topic=f"bf-out-{uuid.uuid4().hex[:6]}")
    with pytest.raises(ConfigError, match="accept-kafka-repeats"):
        run(spark, kafka_settings, with_kafka, 1, backfill=True)

    start_offsets = load_manifest(store, Layout(), 0).metadata["offsets"][name]
    admin.delete_records({TopicPartition(name, int(p)): n + 1 for p, n in start_offsets.items()})
    with pytest.raises(ConfigError, match=rf"{name}\[0\] needs offset \d+, earliest kept is"):
        run(spark, kafka_settings, pipe, 1, backfill=True)
    assert list_checkpoints(store, Layout()) == before  # the refused runs committed nothing
    assert visible_files(tmp_path) == files_before  # and the output is untouched
