"""A source's consumer settings (``KafkaSource(consumer_config=...)``): checked when the
source is defined, handed to both readers, and the JVM reader's fetch defaults."""

from __future__ import annotations

import pytest
from kafka import KafkaConsumer

from microbatch.errors import ConfigError
from microbatch.kafka.reader import build_consumer_config
from microbatch.kafka.spark_source import _SAME_MEANING, consumer_options
from microbatch.runtime import KafkaSource
from microbatch.runtime.consumer_config import TUNABLE
from microbatch.runtime.pipeline import combined_source
from microbatch.settings import Settings


def test_every_tunable_setting_means_the_same_to_both_readers() -> None:
    assert set(KafkaConsumer.DEFAULT_CONFIG) >= TUNABLE
    assert TUNABLE <= _SAME_MEANING
    for name in TUNABLE:
        value = "rack-1" if name in ("client_id", "client_rack") else 7
        options = consumer_options({name: value})
        assert options["kafka." + name.replace("_", ".")] == str(value)


def test_a_source_takes_consumer_settings_and_stays_hashable() -> None:
    source = KafkaSource(topics=("t",), consumer_config={"fetch_max_wait_ms": 5})
    assert source.consumer_config == {"fetch_max_wait_ms": 5}
    assert hash(source) == hash(
        KafkaSource(topics=("t",), consumer_config={"fetch_max_wait_ms": 5})
    )
    assert KafkaSource(topics=("t",), consumer_config={}).consumer_config is None


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"security_protocol": "SSL"}, "set once for the deployment, in MICROBATCH_KAFKA_SECURI"),
        ({"sasl_plain_password": "x"}, "MICROBATCH_KAFKA_SASL_USERNAME/_PASSWORD"),
        ({"ssl_cafile": "/ca.pem"}, "MICROBATCH_KAFKA_SSL_CAFILE"),
        ({"isolation_level": "read_uncommitted"}, "the readers fix it"),
        ({"fetch_max_wait": 10}, "'fetch_max_wait' is not a consumer setting both readers take"),
        ({"fetch_max_wait_ms": "10"}, "must be a whole number >= 0"),
        ({"fetch_max_wait_ms": -1}, "must be a whole number >= 0"),
        ({"client_id": 3}, "must be a string"),
        ([("fetch_max_wait_ms", 10)], "must be a dict"),
    ],
)
def test_unknown_security_and_fixed_settings_are_refused_naming_where_they_go(
    config, message
) -> None:
    with pytest.raises(ConfigError, match=rf"KafkaSource of \['t'\]: .*{message}"):
        KafkaSource(topics=("t",), consumer_config=config)


def test_several_sources_must_agree_on_their_consumer_settings() -> None:
    a = KafkaSource(topics=("a",), consumer_config={"fetch_max_wait_ms": 5})
    b = KafkaSource(topics=("b",))
    with pytest.raises(ConfigError, match="differ in consumer_config"):
        combined_source([a, b], "dataflow 'x'")
    b = KafkaSource(topics=("b",), consumer_config={"fetch_max_wait_ms": 5})
    both = combined_source([a, b], "dataflow 'x'")
    assert both.consumer_config == {"fetch_max_wait_ms": 5}


def test_the_readers_get_the_source_settings_beside_the_deployments_security() -> None:
    secured = Settings(
        kafka_security_protocol="SASL_PLAINTEXT",
        kafka_sasl_username="u",
        kafka_sasl_password="p",
    )
    config = secured.kafka_client_config({"fetch_max_wait_ms": 5})
    assert config["fetch_max_wait_ms"] == 5
    assert config["security_protocol"] == "SASL_PLAINTEXT"
    assert Settings().kafka_client_config({"fetch_max_wait_ms": 5}) == {"fetch_max_wait_ms": 5}
    assert Settings().kafka_client_config() == {}
    assert build_consumer_config("b:9092", config)["fetch_max_wait_ms"] == 5
    assert consumer_options(config)["kafka.fetch.max.wait.ms"] == "5"


def test_the_jvm_reader_waits_briefly_for_fetches_of_written_ranges() -> None:
    assert consumer_options()["kafka.fetch.max.wait.ms"] == "10"  # not Java's 500
    assert consumer_options({"fetch_max_wait_ms": 200})["kafka.fetch.max.wait.ms"] == "200"
