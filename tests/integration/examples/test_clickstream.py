"""The example pipeline on the real stack equals its plain-Python reference.

Real Kafka, real SeaweedFS (checkpoints and Parquet on S3), real Spark, and the profile
service over HTTP with latency and errors; a rescale and an injected crash on the way.
"""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path

import pytest

from microbatch.examples.clicks import MALFORMED, T0, generate_clicks
from microbatch.examples.clickstream import (
    ClickstreamConfig,
    clickstream_pipeline,
    reference_sessions,
)
from microbatch.examples.profile_service import ProfileService
from microbatch.localstack.topics import create_topics, produce, read_topic
from microbatch.runtime import BatchOptions, BatchRunner
from microbatch.sinks import read_parquet_sink

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def profiles(tmp_path_factory) -> ProfileService:
    service = ProfileService(5, 0.1, tmp_path_factory.mktemp("profiles") / "service.log")
    yield service
    service.stop()


def test_clickstream_sessions_equal_the_reference_exactly_once(
    spark, stack_settings, profiles, tmp_path: Path
) -> None:
    run = uuid.uuid4().hex[:8]
    config = ClickstreamConfig.fresh(
        stack_settings.s3_bucket,
        "test-clickstream",
        run,
        profile_url=profiles.url,
        parallelism=2,
        idle_timeout_s=2.0,
    )
    pipeline = clickstream_pipeline(config)
    bootstrap = stack_settings.kafka_bootstrap_servers
    create_topics(
        bootstrap, {config.topic: 3, config.sessions_topic: 2, config.dead_letter_topic: 1}
    )
    clicks = generate_clicks(users=40, hours=6, seed=5)
    half = T0 + 3 * 3_600_000
    first = [c for c in clicks if c["ts"] < half]
    second = [c for c in clicks if c["ts"] >= half]

    def encode(c: dict) -> tuple[bytes, bytes]:
        return c["user_id"].encode(), json.dumps(c).encode()

    def run_batch(**options) -> dict:
        return BatchRunner(spark, pipeline, stack_settings).run(BatchOptions(**options)).to_json()

    produce(bootstrap, config.topic, [encode(c) for c in first] + [(None, m) for m in MALFORMED])
    r0 = run_batch(run_id="a")
    late = {**first[0], "ts": T0 - 1, "page": "/late"}
    produce(bootstrap, config.topic, [encode(c) for c in [*second, late]])
    with pytest.raises(Exception, match="injected crash"):
        run_batch(run_id="b", crash_at="after_commit")
    r1 = run_batch(run_id="b", parallelism=3)  # publishes batch 1, then runs batch 2
    time.sleep(config.idle_timeout_s + 0.5)
    r2 = run_batch(run_id="c", parallelism=3)

    assert r0["records_in"] == len(first) + len(MALFORMED)
    assert r1["recovered_publish"] == 1 and r1["records_in"] == 0
    expected = reference_sessions(clicks, r2["watermark"])
    assert len(expected) > 50

    def key(r: dict) -> tuple:
        return (r["user_id"], r["session_start"])

    parquet = sorted(
        read_parquet_sink(f"{config.root}/sessions", stack_settings).to_pylist(), key=key
    )
    kafka = sorted(
        (json.loads(m.value) for m in read_topic(bootstrap, config.sessions_topic)), key=key
    )
    assert parquet == expected
    assert kafka == expected
    reasons = sorted(
        dict(m.headers)["microbatch.reason"].decode()
        for m in read_topic(bootstrap, config.dead_letter_topic)
    )
    assert reasons == ["bad_event_time", "enrichment_error", "late", "undecodable"]
    # Each dead letter names its source record by integer coordinates and carries its bytes.
    source = {(m.partition, m.offset): m.value for m in read_topic(bootstrap, config.topic)}
    for m in read_topic(bootstrap, config.dead_letter_topic):
        headers = dict(m.headers)
        partition, offset = headers["microbatch.partition"], headers["microbatch.offset"]
        assert partition.isdigit() and offset.isdigit(), (partition, offset)
        assert source[(int(partition), int(offset))] == m.value
