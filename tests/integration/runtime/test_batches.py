"""The batch protocol end to end on real Kafka, Spark and a local checkpoint store.

Reference results are computed in plain Python from what the test produced.
"""

from __future__ import annotations

import collections
import contextlib
import uuid
from pathlib import Path

import pytest

from microbatch.checkpoint import Layout, list_checkpoints, load_manifest, read_key_state
from microbatch.errors import BatchError, ProcessError
from microbatch.runtime import BatchOptions, BatchRunner
from microbatch.sinks import read_parquet_sink
from microbatch.storage import open_store
from tests.integration.runtime.pipelines import click, count_pipeline, timer_pipeline

pytestmark = pytest.mark.integration


def new_topic(admin, partitions: int = 3) -> str:
    name = f"rt-{uuid.uuid4().hex[:10]}"
    spec = {"num_partitions": partitions, "replication_factor": 1, "configs": {}}
    admin.create_topics({name: spec}, wait_for_metadata=True)
    return name


def produce(bootstrap: str, topic: str, values: list[bytes]) -> list[tuple[int, int]]:
    """Send in order; returns (partition, offset) of each value."""
    from kafka import KafkaProducer

    producer = KafkaProducer(bootstrap_servers=bootstrap, acks="all", linger_ms=5)
    try:
        futures = [producer.send(topic, key=v[:12], value=v) for v in values]
        producer.flush()
        return [(f.get(30).partition, f.get(30).offset) for f in futures]
    finally:
        producer.close()


def clicks(n: int, users: int = 7, seed: int = 0) -> list[bytes]:
    return [click(f"u{(i * 5 + seed) % users}", f"/p{i % 4}", ts=1000 * i) for i in range(n)]


def totals(values: list[bytes]) -> dict[str, int]:
    import json

    counts: collections.Counter[str] = collections.Counter()
    for v in values:
        with contextlib.suppress(ValueError, KeyError):
            counts[json.loads(v)["user"]] += 1
    return dict(counts)


def runner(spark, settings, pipeline) -> BatchRunner:
    return BatchRunner(spark, pipeline, settings)


def test_batches_count_exactly_once_across_a_rescale_with_dead_letters(
    spark, kafka_settings, bootstrap, admin, tmp_path: Path
) -> None:
    topic = new_topic(admin)
    bad = [b"{not json", b"\xff\xfe", b'{"page": "/no-user"}']
    values = clicks(120) + bad
    produced = produce(bootstrap, topic, values)
    pipe = count_pipeline(topic, str(tmp_path), max_records_per_batch=70, parallelism=2)

    first = runner(spark, kafka_settings, pipe).run(BatchOptions(run_id="t1"))
    second = runner(spark, kafka_settings, pipe).run(BatchOptions(parallelism=3, run_id="t2"))
    third = runner(spark, kafka_settings, pipe).run(BatchOptions(parallelism=3, run_id="t3"))

    assert (first.batch_id, second.batch_id, third.batch_id) == (0, 1, 2)
    assert first.records_in == 70 and second.records_in == len(values) - 70
    assert third.records_in == 0 and third.lag and all(v == 0 for v in third.lag.values())
    rows = read_parquet_sink(str(tmp_path / "counts")).to_pylist()
    per_user: collections.Counter[str] = collections.Counter()
    final: dict[str, int] = {}
    for r in rows:
        per_user[r["user"]] += r["clicks"]
        final[r["user"]] = max(final.get(r["user"], 0), r["total"])
    assert dict(per_user) == totals(values) == final

    dead = read_parquet_sink(str(tmp_path / "dead")).to_pylist()
    where = {(d["partition"], d["offset"]): d for d in dead}
    assert sorted(where) == sorted(produced[-3:])
    reasons = sorted(d["reason"] for d in dead)
    assert reasons == ["missing_key", "undecodable", "undecodable"]
    assert {d["raw_value"] for d in dead} == set(bad)

    store = open_store(str(tmp_path / "checkpoints"))
    assert list_checkpoints(store, Layout()) == [0, 1, 2]
    m1 = load_manifest(store, Layout(), 1)
    assert m1.parallelism == 3 and m1.metadata["batch"]["parallelism"] == 3
    state = read_key_state(store, Layout(), "u3")
    assert state["total"] == totals(values)["u3"]
    assert len(state["pages"]) == totals(values)["u3"]


def test_a_second_run_holding_the_pipeline_is_refused(
    spark, kafka_settings, bootstrap, admin, tmp_path: Path
) -> None:
    from microbatch.runtime import fence

    topic = new_topic(admin, 1)
    produce(bootstrap, topic, clicks(5))
    pipe = count_pipeline(topic, str(tmp_path))
    store = open_store(pipe.checkpoints)
    fence.acquire(store, pipe.name, "someone-else", 600)
    with pytest.raises(BatchError, match="being run by 'someone-else'"):
        runner(spark, kafka_settings, pipe).run(BatchOptions(run_id="me"))
    fence.release(store, "someone-else")
    assert runner(spark, kafka_settings, pipe).run(BatchOptions(run_id="me")).records_in == 5


def test_process_errors_fail_the_batch_or_dead_letter_the_keys_records(
    spark, kafka_settings, bootstrap, admin, tmp_path: Path
) -> None:
    topic = new_topic(admin, 1)
    values = [click("a", "/1"), click("b", "/1"), click("b", "/2", explode=True), click("a", "/3")]
    produce(bootstrap, topic, values)
    failing = count_pipeline(topic, str(tmp_path / "fail"))
    with pytest.raises(Exception, match="process\\(\\) raised for key 'b'"):
        runner(spark, kafka_settings, failing).run(BatchOptions(run_id="f"))
    store = open_store(failing.checkpoints)
    assert list_checkpoints(store, Layout()) == []

    lenient = count_pipeline(topic, str(tmp_path / "dl"), on_process_error="dead_letter")
    result = runner(spark, kafka_settings, lenient).run(BatchOptions(run_id="d"))
    assert result.dead_letter_reasons == {"process_failed": 2}
    rows = read_parquet_sink(str(tmp_path / "dl" / "counts")).to_pylist()
    assert rows == [{"user": "a", "clicks": 2, "total": 2}]
    # b's state was rolled back: no partial update survived the failed call.
    assert read_key_state(open_store(lenient.checkpoints), Layout(), "b") == {}
    assert ProcessError.__name__ in str(ProcessError)


def test_timers_fire_when_the_batch_watermark_passes_them(
    spark, kafka_settings, bootstrap, admin, tmp_path: Path
) -> None:
    topic = new_topic(admin, 1)
    produce(bootstrap, topic, [click("a", "/", ts=1000), click("b", "/", ts=5000)])
    pipe = timer_pipeline(topic, str(tmp_path))
    r1 = runner(spark, kafka_settings, pipe).run(BatchOptions(run_id="a"))
    assert r1.watermark == 5000
    fired = read_parquet_sink(str(tmp_path / "fired")).to_pylist()
    assert fired == [{"user": "a", "fired": 2000}]  # b's timer (6000) is not due yet

    produce(bootstrap, topic, [click("c", "/", ts=9000), click("a", "/", ts=100)])
    r2 = runner(spark, kafka_settings, pipe).run(BatchOptions(run_id="b"))
    assert r2.watermark == 9000
    assert r2.dead_letter_reasons == {"late": 1}  # ts=100 is behind watermark 5000
    fired = read_parquet_sink(str(tmp_path / "fired")).to_pylist()
    assert fired == [{"user": "a", "fired": 2000}, {"user": "b", "fired": 6000}]


def test_replay_from_a_checkpoint_reprocesses_later_records_and_replaces_their_parquet(
    spark, kafka_settings, bootstrap, admin, tmp_path: Path
) -> None:
    from microbatch.cli import main

    topic = new_topic(admin, 2)
    values = clicks(60)
    produce(bootstrap, topic, values[:30])
    pipe = count_pipeline(topic, str(tmp_path))
    runner(spark, kafka_settings, pipe).run(BatchOptions(run_id="a"))  # checkpoint 0
    produce(bootstrap, topic, values[30:])
    runner(spark, kafka_settings, pipe).run(BatchOptions(run_id="b"))  # checkpoint 1
    before = sorted(read_parquet_sink(str(tmp_path / "counts")).to_pylist(), key=str)

    replayed = runner(spark, kafka_settings, pipe).replay_from(0)  # checkpoint 2 = copy of 0
    assert replayed.checkpoint_id == 2
    store = open_store(pipe.checkpoints)
    assert read_key_state(store, Layout(), "u3")["total"] == totals(values[:30])["u3"]
    kept = sorted(read_parquet_sink(str(tmp_path / "counts")).to_pylist(), key=str)
    assert kept == before  # batch 1's output stays visible until it is recomputed

    again = runner(spark, kafka_settings, pipe).run(BatchOptions(run_id="c"))  # checkpoint 3
    assert (again.batch_id, again.records_in) == (3, 30)
    after = sorted(read_parquet_sink(str(tmp_path / "counts")).to_pylist(), key=str)
    assert after == before
    assert read_key_state(store, Layout(), "u3")["total"] == totals(values)["u3"]

    with_kafka = count_pipeline(topic, str(tmp_path / "k"), out_topic=new_topic(admin, 1))
    with pytest.raises(Exception, match="--accept-kafka-repeats"):
        runner(spark, kafka_settings, with_kafka).replay_from(0)
    assert main(["replay", "/nonexistent.py", "--from-checkpoint", "0"]) == 2  # config error
