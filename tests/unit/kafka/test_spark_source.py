"""Pure parts of the JVM reader: offset JSON, option mapping, reader choice, the probe."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from microbatch.errors import ConfigError, SourceError
from microbatch.kafka.offsets import OffsetRange
from microbatch.kafka.spark_source import (
    FIXED_OPTIONS,
    check_available,
    choose_reader,
    connector_problem,
    consumer_options,
    range_options,
    source_options,
)
from microbatch.localstack.spark_kafka import artifact_name
from microbatch.runtime import KafkaSource
from microbatch.settings import Settings
from microbatch.spark import with_kafka_connector


def test_range_options_read_exactly_start_to_end_per_partition():
    ranges = [
        OffsetRange("b", 0, 7, 7),  # empty: left out
        OffsetRange("clicks", 3, 100, 250),
        OffsetRange("b", 1, 0, 5),
        OffsetRange("clicks", 0, 0, 1),
    ]
    options = {k: json.loads(v) for k, v in range_options(ranges).items()}
    assert options == {
        "assign": {"b": [1], "clicks": [0, 3]},
        "startingOffsets": {"b": {"1": 0}, "clicks": {"0": 0, "3": 100}},
        "endingOffsets": {"b": {"1": 5}, "clicks": {"0": 1, "3": 250}},
    }


def test_range_options_refuse_two_ranges_of_one_partition():
    pieces = OffsetRange("clicks", 2, 0, 100).split(40)
    with pytest.raises(SourceError, match=r"clicks\[2\]: more than one range"):
        range_options(pieces)


def test_consumer_options_map_kafka_python_names_over_the_jvm_defaults():
    options = consumer_options({"fetch_max_bytes": 1024, "client_id": "me", "check_crcs": True})
    assert options["kafka.fetch.max.bytes"] == "1024"
    assert options["kafka.client.id"] == "me"
    assert options["kafka.max.poll.records"] == "10000"  # a default; fetch sizes stay Java's
    assert "kafka.max.partition.fetch.bytes" not in options
    assert consumer_options({"max_poll_records": 500})["kafka.max.poll.records"] == "500"
    assert all(name.startswith("kafka.") for name in options)
    assert "kafka.check.crcs" not in options  # fixed settings: the source sets them


def test_consumer_options_map_security_settings():
    options = consumer_options(
        {
            "security_protocol": "SASL_SSL",
            "sasl_mechanism": "SCRAM-SHA-512",
            "sasl_plain_username": "svc",
            "sasl_plain_password": 'p"a\\ss',
            "ssl_cafile": "/etc/ca.pem",
            "ssl_check_hostname": False,
        }
    )
    assert options["kafka.security.protocol"] == "SASL_SSL"
    assert options["kafka.sasl.mechanism"] == "SCRAM-SHA-512"
    assert options["kafka.sasl.jaas.config"] == (
        "org.apache.kafka.common.security.scram.ScramLoginModule required "
        'username="svc" password="p\\"a\\\\ss";'
    )
    assert options["kafka.ssl.truststore.type"] == "PEM"
    assert options["kafka.ssl.truststore.location"] == "/etc/ca.pem"
    assert options["kafka.ssl.endpoint.identification.algorithm"] == ""
    assert "kafka.sasl.plain.username" not in options


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"ssl_certfile": "/c.pem", "api_version": (2, 8)}, r"\['api_version', 'ssl_certfile'\]"),
        ({"sasl_plain_username": "svc"}, "only together"),
        (
            dict(sasl_mechanism="OAUTHBEARER", sasl_plain_username="u", sasl_plain_password="p"),
            "OAUTHBEARER",
        ),
        ({"isolation_level": "read_uncommitted"}, "may not change"),
        ({"auto_offset_reset": "earliest"}, "may not change"),
    ],
)
def test_consumer_options_refuse_what_cannot_be_mapped(config, message):
    with pytest.raises(ConfigError, match=message):
        consumer_options(config)


def test_source_options_fix_what_decides_which_records_are_read():
    options = source_options("b1:9092,b2:9092", [OffsetRange("t", 0, 5, 9)])
    assert options["kafka.bootstrap.servers"] == "b1:9092,b2:9092"
    assert options["kafka.isolation.level"] == "read_committed"
    assert options["failOnDataLoss"] == "true"
    assert options["includeHeaders"] == "true"
    assert {k: options[k] for k in FIXED_OPTIONS} == FIXED_OPTIONS
    assert json.loads(options["startingOffsets"]) == {"t": {"0": 5}}


@pytest.mark.parametrize(
    ("requested", "problem", "chosen"),
    [
        ("auto", None, "spark"),
        ("auto", "no connector", "python"),
        ("confluent", None, "confluent"),
        ("confluent", "no connector", "confluent"),
        ("native", None, "native"),
        ("native", "no connector", "native"),
        ("python", None, "python"),
        ("python", "no connector", "python"),
        ("spark", None, "spark"),
    ],
)
def test_choose_reader(requested, problem, chosen):
    assert choose_reader("clicks", requested, problem) == chosen


@pytest.mark.parametrize(
    ("problem", "chosen"), [(None, "confluent"), ("no connector", "confluent")]
)
def test_auto_prefers_confluent_kafka_when_it_can_run(problem, chosen):
    assert choose_reader("clicks", "auto", problem, confluent_problem=None) == chosen


@pytest.mark.parametrize("confluent", [None, "no confluent-kafka"])
@pytest.mark.parametrize("problem", [None, "no connector"])
def test_auto_prefers_the_native_reader_when_it_can_run(problem, confluent):
    chosen = choose_reader("clicks", "auto", problem, confluent, native_problem=None)
    assert chosen == "native"


def test_auto_takes_confluent_kafka_when_the_native_reader_cannot_run():
    why = "KafkaSource(reader='native') is built without TLS or SASL SCRAM-SHA-256"
    assert choose_reader("clicks", "auto", None, None, native_problem=why) == "confluent"


@pytest.mark.parametrize(("problem", "chosen"), [(None, "spark"), ("no connector", "python")])
def test_auto_falls_back_when_confluent_kafka_cannot_run(problem, chosen):
    why = "consumer setting(s) ['max_poll_records'] have no librdkafka setting"
    assert choose_reader("clicks", "auto", problem, confluent_problem=why) == chosen


def test_confluent_problem_names_what_librdkafka_cannot_take():
    from microbatch.kafka.confluent_reader import confluent_problem

    assert confluent_problem({"fetch_max_wait_ms": 10}) is None
    assert "max_poll_records" in str(confluent_problem({"max_poll_records": 10}))


def test_spark_reader_without_the_connector_says_how_to_add_it():
    with pytest.raises(ConfigError) as err:
        choose_reader("clicks", "spark", "Spark has no data source 'kafka'")
    message = str(err.value)
    for part in (
        "pipeline 'clicks'",
        "no data source 'kafka'",
        "make jars",
        "spark.jars",
        "--packages org.apache.spark:spark-sql-kafka-0-10_2.13",
        "'python'",
    ):
        assert part in message


def test_kafka_source_validates_the_reader():
    assert KafkaSource(topics=("t",)).reader == "auto"
    assert KafkaSource(topics=("t",), reader="spark").reader == "spark"
    with pytest.raises(ConfigError, match=r"one of 'auto', 'python', 'spark'.*'jvm'"):
        KafkaSource(topics=("t",), reader="jvm")  # type: ignore[arg-type]


class _Reader:
    """Just enough of ``spark.read`` for the probe."""

    def __init__(self, error: Exception | None) -> None:
        self.error = error

    def format(self, name: str) -> _Reader:
        return self

    def options(self, **options: str) -> _Reader:
        return self

    def load(self) -> _Reader:
        if self.error is not None:
            raise self.error
        return self

    schema = "key binary, ..."


class _Session:
    def __init__(self, error: Exception | None = None) -> None:
        self.probes = 0
        self.error = error

    @property
    def read(self) -> _Reader:
        self.probes += 1
        return _Reader(self.error)


def test_connector_probe_runs_once_per_session_and_names_a_missing_source():
    present = _Session()
    assert connector_problem(present) is None
    assert connector_problem(present) is None
    assert present.probes == 1
    missing = _Session(RuntimeError("[DATA_SOURCE_NOT_FOUND] Failed to find data source: kafka."))
    assert "no data source 'kafka'" in (connector_problem(missing) or "")
    assert connector_problem(missing) and missing.probes == 1


def test_connector_probe_failing_otherwise_is_asked_again():
    flaky = _Session(RuntimeError("UNAVAILABLE: connection reset"))
    assert "connection reset" in (connector_problem(flaky) or "")
    flaky.error = None
    assert connector_problem(flaky) is None
    assert flaky.probes == 2


def test_artifact_name_drops_only_the_version():
    assert artifact_name("spark-sql-kafka-0-10_2.13-4.2.0.jar") == "spark-sql-kafka-0-10_2.13"
    assert artifact_name("kafka-clients-3.9.2.jar") == "kafka-clients"
    assert artifact_name("zstd-jni-1.5.6-10.jar") == "zstd-jni"
    assert artifact_name("commons-pool2-2.13.1.jar") == "commons-pool2"


def test_session_conf_gets_the_connector_jars_for_local_and_standalone(monkeypatch):
    jars = [Path("/h/spark-kafka/a.jar"), Path("/h/spark-kafka/b.jar")]
    monkeypatch.setattr("microbatch.spark_jars.spark_kafka_jars", lambda home: jars)
    for master in ("local[2]", "spark://127.0.0.1:7077"):
        conf = with_kafka_connector(Settings(spark_master=master), {"spark.jars": "/mine.jar"})
        assert conf["spark.jars"] == "/mine.jar,/h/spark-kafka/a.jar,/h/spark-kafka/b.jar"
    assert "spark.jars" not in with_kafka_connector(Settings(spark_master="yarn"), {})
    monkeypatch.setattr("microbatch.spark_jars.spark_kafka_jars", lambda home: [])
    assert "spark.jars" not in with_kafka_connector(Settings(spark_master="local[2]"), {})


class _View:
    """Earliest and latest offsets of one partition, as a broker would answer."""

    bootstrap_servers = "b:9092"

    def __init__(self, earliest: int, latest: int) -> None:
        self.earliest, self.latest = earliest, latest

    def beginning_offsets(self, tps):
        return dict.fromkeys(tps, self.earliest)

    def end_offsets(self, tps):
        return dict.fromkeys(tps, self.latest)


def test_check_available_names_a_start_retention_deleted_and_a_range_past_the_end():
    r = OffsetRange("clicks", 3, 10, 100)
    check_available("b:9092", [r], _View(earliest=10, latest=100))  # exactly available
    with pytest.raises(SourceError) as err:
        check_available("b:9092", [r], _View(earliest=50, latest=100))
    for part in ("clicks[3] [10, 100) on b:9092", "offset 10 is no longer available",
                 "earliest kept offset is 50", "on_out_of_range"):  # fmt: skip
        assert part in str(err.value)
    with pytest.raises(SourceError, match=r"ends at offset 90, before the range does"):
        check_available("b:9092", [r], _View(earliest=0, latest=90))
