"""A pipeline on a secured cluster: every Kafka client of a batch authenticates with SASL.

The run's broker also listens with SASL_PLAINTEXT (PLAIN and SCRAM); ``sasl_settings``
point at that listener. Planning, the stage-1 readers (Spark's Kafka source in the JVM,
kafka-python, confluent-kafka and the native reader in the tasks), the transactional
Kafka sink and the offset mirror must all connect as the configured user; a wrong
password must fail the batch before anything is committed, saying what to check.
"""

from __future__ import annotations

import dataclasses
import uuid
from pathlib import Path

import pytest

from microbatch.checkpoint import Layout, latest_manifest
from microbatch.errors import SourceError
from microbatch.kafka import consumer_group_name
from microbatch.localstack.topics import read_topic
from microbatch.runtime import BatchOptions, BatchRunner
from microbatch.sinks import read_parquet_sink
from microbatch.storage import open_store
from tests.integration.runtime.pipelines import count_pipeline
from tests.integration.runtime.test_batches import clicks, new_topic, produce, totals

pytestmark = pytest.mark.integration

VALUES = clicks(60, users=5, seed=11)


@pytest.fixture(scope="module")
def source_topic(bootstrap, admin) -> str:
    topic = new_topic(admin, 2)
    produce(bootstrap, topic, VALUES)
    return topic


@pytest.mark.parametrize(
    ("reader", "mechanism", "used"),
    [
        ("spark", "PLAIN", "spark"),
        ("python", "PLAIN", "python"),
        ("native", "PLAIN", "native"),
        ("spark", "SCRAM-SHA-512", "spark"),
        ("python", "SCRAM-SHA-256", "python"),
        ("confluent", "SCRAM-SHA-512", "confluent"),
        # The native reader is built without OpenSSL (SCRAM's hashes): auto takes librdkafka
        # through confluent-kafka instead.
        ("auto", "SCRAM-SHA-256", "confluent"),
    ],
)
def test_a_batch_on_a_sasl_cluster_reads_publishes_and_mirrors_as_the_configured_user(
    reader, mechanism, used, spark, sasl_settings, bootstrap, admin, source_topic, tmp_path: Path
) -> None:
    sasl_settings = dataclasses.replace(sasl_settings, kafka_sasl_mechanism=mechanism)
    out_topic = new_topic(admin, 1)
    pipe = count_pipeline(source_topic, str(tmp_path), out_topic=out_topic)
    pipe = dataclasses.replace(
        pipe,
        name=f"sasl-{reader}-{uuid.uuid4().hex[:8]}",  # its own mirrored consumer group
        source=dataclasses.replace(pipe.source, reader=reader),
    )

    runner = BatchRunner(spark, pipe, sasl_settings)
    result = runner.run(BatchOptions(run_id=f"sasl-{reader}"))

    assert result.status == "committed" and result.records_in == len(VALUES)
    assert runner.stage_one_reader == used
    counts = read_parquet_sink(str(tmp_path / "counts")).to_pylist()
    assert {r["user"]: r["total"] for r in counts} == totals(VALUES)
    published = sorted(m.value for m in read_topic(bootstrap, out_topic))
    assert len(published) == len(counts) == len(totals(VALUES))
    # The offset mirror only warns when it cannot connect: check it arrived.
    group = consumer_group_name(pipe.name)
    mirrored = admin.list_group_offsets(group)[group]
    ends = latest_manifest(open_store(pipe.checkpoints), Layout()).metadata["offsets"]
    assert {f"{tp.topic}/{tp.partition}": o.offset for tp, o in mirrored.items()} == _flat(ends)


def _flat(offsets: dict) -> dict[str, int]:
    """``{"topic/partition": next offset}`` of a manifest's offsets."""
    from microbatch.kafka import snapshot_from_json

    return {f"{t}/{p}": o for (t, p), o in snapshot_from_json(offsets).items()}


def test_a_wrong_sasl_password_fails_the_batch_before_anything_is_committed(
    spark, sasl_settings, source_topic, tmp_path: Path
) -> None:
    # kafka-python retries a refused login until the planner's timeout: 5 s, not 30
    wrong = dataclasses.replace(
        sasl_settings, kafka_sasl_password="not-the-password", kafka_timeout_s=5.0
    )
    pipe = count_pipeline(source_topic, str(tmp_path))

    with pytest.raises(SourceError, match="MICROBATCH_KAFKA_SECURITY_"):
        BatchRunner(spark, pipe, wrong).run(BatchOptions(run_id="sasl-wrong"))

    assert latest_manifest(open_store(pipe.checkpoints), Layout()) is None
