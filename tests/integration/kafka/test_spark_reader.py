"""Spark's JVM Kafka source reads exactly what the kafka-python reader reads.

On a real broker: plain records with and without headers, a committed and an aborted
transaction (offset gaps: markers and aborted records), a tombstone; then a pipeline batch
with each reader (confluent-kafka's and the native one too) gives identical outputs and
state. The reference is always the Python reader (``read_ranges``), itself checked against
a plain ``read_committed`` consumer in ``test_kafka_source.py``.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from microbatch.errors import SourceError
from microbatch.kafka import KAFKA_SCHEMA, KafkaBrokerView, OffsetRange, TopicPartition, read_ranges
from microbatch.kafka.spark_source import connector_problem, read_ranges_spark
from microbatch.runtime import BatchOptions, BatchRunner
from microbatch.sinks import read_parquet_sink
from tests.integration.kafka.test_kafka_source import new_topic, produce
from tests.integration.runtime.pipelines import click, count_pipeline
from tests.integration.runtime.test_crashes import all_state

pytestmark = pytest.mark.integration

#: The first kafka-clients version whose ``poll`` returns when the position moved past
#: offsets without visible records (transaction markers, aborted records), KAFKA-12980.
POLL_RETURNS_ON_ADVANCE = (3, 2)


@pytest.fixture(scope="module", autouse=True)
def connector(spark) -> None:
    """The shared session has the connector (`make jars` resolved it; spark_session added
    it): these tests must not pass by quietly reading with kafka-python."""
    problem = connector_problem(spark)
    assert problem is None, f"{problem}: `make jars` resolves the connector for the tests"


def whole(bootstrap: str, topic: str, partitions: int) -> list[OffsetRange]:
    tps = [TopicPartition(topic, p) for p in range(partitions)]
    with KafkaBrokerView(bootstrap) as view:
        end = view.end_offsets(tps)
    return [OffsetRange(topic, tp.partition, 0, end[tp]) for tp in tps]


def rows_of(table: Any) -> list[dict[str, Any]]:
    return sorted(table.to_pylist(), key=lambda r: (r["partition"], r["offset"]))


def rows(frame: Any) -> list[dict[str, Any]]:
    return rows_of(frame.toArrow())


def test_jvm_reader_rows_equal_the_python_readers_rows(spark, bootstrap, admin) -> None:
    topic = new_topic(admin, 2)
    headers = [("trace", b"t-1"), ("empty", b"")]
    produce(bootstrap, topic, [(0, b"k0", b"plain-0"), (1, None, b"plain-1")], headers=headers)
    produce(bootstrap, topic, [(0, b"k1", b"tx-0"), (1, b"k2", b"tx-1")], transaction="commit")
    produce(bootstrap, topic, [(0, b"x", b"aborted-0"), (1, None, b"aborted-1")] * 3,
            transaction="abort")  # fmt: skip
    produce(bootstrap, topic, [(0, b"k0", None)])  # a tombstone
    produce(bootstrap, topic, [(i % 2, None, f"after-{i}".encode()) for i in range(6)])
    ranges = whole(bootstrap, topic, 2)

    python = read_ranges(spark, bootstrap, ranges).toArrow()
    jvm = read_ranges_spark(spark, bootstrap, ranges).toArrow()

    assert [f.type for f in jvm.schema] == [f.type for f in KAFKA_SCHEMA]
    ours = rows_of(jvm)
    assert ours == rows_of(python)
    values = sorted(r["value"] or b"" for r in ours)
    assert values == sorted([b"", b"plain-0", b"plain-1", b"tx-0", b"tx-1"]
                            + [f"after-{i}".encode() for i in range(6)])  # fmt: skip
    assert [h for r in ours for h in r["headers"]] == [
        {"key": k, "value": v} for k, v in headers * 2
    ]
    assert all(r["timestamp"] > 1_600_000_000_000 for r in ours)  # epoch ms, not µs


def test_ranges_inside_and_after_an_aborted_tail_are_read_without_waiting(
    spark, bootstrap, admin
) -> None:
    topic = new_topic(admin, 1)
    produce(bootstrap, topic, [(0, None, f"a{i}".encode()) for i in range(5)])
    produce(bootstrap, topic, [(0, None, f"c{i}".encode()) for i in range(5)], transaction="commit")
    produce(bootstrap, topic, [(0, None, f"x{i}".encode()) for i in range(5)], transaction="abort")
    (whole_range,) = whole(bootstrap, topic, 1)
    assert whole_range.end == 17  # 15 records + 2 control markers
    # Ranges from 10 and 12 hold no record past their start, only a marker and aborted
    # records. Spark's source steps over those offsets once the client's poll returns
    # with the position past them: at once with this client (KAFKA-12980), only after
    # kafkaConsumer.pollTimeoutMs (60 s) with an older one, and with the same rows.
    version = spark._jvm.org.apache.kafka.common.utils.AppInfoParser.getVersion()
    assert tuple(int(n) for n in version.split(".")[:2]) >= POLL_RETURNS_ON_ADVANCE, version

    for start in (0, 10, 12):  # from the beginning, at the commit marker, inside the abort
        r = dataclasses.replace(whole_range, start=start)
        got = rows(read_ranges_spark(spark, bootstrap, [r]))
        assert got == rows(read_ranges(spark, bootstrap, [r], poll_timeout_s=5))
        expected = [f"a{i}".encode() for i in range(5)] + [f"c{i}".encode() for i in range(5)]
        assert [row["value"] for row in got] == expected[start:]


def test_a_start_deleted_by_retention_fails_the_read_never_skips(spark, bootstrap, admin) -> None:
    from kafka import TopicPartition as KTP

    topic = new_topic(admin, 1)
    produce(bootstrap, topic, [(0, None, f"{i}".encode()) for i in range(100)])
    admin.delete_records({KTP(topic, 0): 50})
    r = OffsetRange(topic, 0, 10, 100)

    with pytest.raises(SourceError, match="offset 10 is no longer available") as err:
        read_ranges_spark(spark, bootstrap, [r])
    assert f"{topic}[0] [10, 100) on {bootstrap}" in str(err.value)
    # Without the driver's check (retention racing the read), Spark's own check fails it.
    unchecked = read_ranges_spark(spark, bootstrap, [r], check=False)
    with pytest.raises(Exception, match=r"(?i)lost|out of range|OffsetOutOfRange"):
        unchecked.collect()


def outcome(root: Path) -> dict[str, Any]:
    def sink(name: str) -> list[dict[str, Any]]:
        table = read_parquet_sink(str(root / name)).to_pylist()
        return sorted(table, key=lambda r: tuple(str(v) for v in r.values()))

    return {"counts": sink("counts"), "dead": sink("dead"), "state": all_state(root)}


def test_pipeline_batches_are_identical_with_either_reader(
    spark, kafka_settings, bootstrap, admin, tmp_path: Path
) -> None:
    topic = new_topic(admin, 3)
    plain = [(i % 3, None, click(f"u{i % 5}", f"/p{i}", ts=i)) for i in range(40)]
    produce(bootstrap, topic, plain)
    produce(bootstrap, topic, [(i % 3, b"t", click("t", f"/t{i}")) for i in range(9)],
            transaction="commit")  # fmt: skip
    produce(bootstrap, topic, [(i % 3, b"a", click("aborted", "/")) for i in range(9)],
            transaction="abort")  # fmt: skip
    produce(bootstrap, topic, [(0, None, b"{oops"), (1, None, click("u1", "/late"))])

    results = {}
    for reader in ("python", "spark", "confluent", "native"):
        base = count_pipeline(topic, str(tmp_path / reader), max_records_per_batch=30)
        pipe = dataclasses.replace(base, source=dataclasses.replace(base.source, reader=reader))
        used, records_in = [], 0
        runner = BatchRunner(spark, pipe, kafka_settings)  # one runner, batch after batch
        for batch in range(4):  # the cap counts offsets: 62 with markers and aborted records
            records_in += runner.run(BatchOptions(run_id=f"{reader}-{batch}")).records_in
            used.append(runner.stage_one_reader)
        assert used == [reader, reader, reader, None]  # the last batch has nothing to read
        assert records_in == 40 + 9 + 2
        results[reader] = outcome(tmp_path / reader)

    assert results["spark"] == results["python"]
    assert results["confluent"] == results["python"]
    assert results["native"] == results["python"]
    assert sum(r["clicks"] for r in results["spark"]["counts"]) == 40 + 9 + 1
    assert len(results["spark"]["dead"]) == 1
