"""The confluent-kafka reader's settings: kafka-python names mapped to librdkafka's, and
what it refuses (when the pipeline is built, naming the setting and the reader)."""

from __future__ import annotations

import logging

import pytest
from confluent_kafka import Consumer

from microbatch.errors import ConfigError
from microbatch.kafka.confluent_reader import FIXED, librdkafka_config
from microbatch.runtime import KafkaSource
from microbatch.runtime.consumer_config import TUNABLE
from microbatch.settings import Settings

#: Tunables with no librdkafka setting of the same meaning.
UNMAPPED = {"max_poll_records"}


def librdkafka_accepts(config: dict) -> None:
    """librdkafka refuses an unknown property when the client is made (nothing connects
    before the first call that needs a broker)."""
    quiet = logging.getLogger("test-confluent-config")
    Consumer({**config, **FIXED, "bootstrap.servers": "127.0.0.1:9", "logger": quiet}).close()


def test_every_tunable_librdkafka_has_maps_to_a_setting_it_accepts() -> None:
    config = {
        name: "rack-1" if name in ("client_id", "client_rack") else 7000
        for name in TUNABLE - UNMAPPED
    }
    mapped = librdkafka_config(config)
    assert mapped["fetch.wait.max.ms"] == 7000 and mapped["socket.timeout.ms"] == 7000
    assert mapped["socket.receive.buffer.bytes"] == 7000 and mapped["client.rack"] == "rack-1"
    assert len(mapped) == len(config) + 1  # and message.max.bytes, not above fetch.max.bytes
    assert mapped["message.max.bytes"] == 7000
    librdkafka_accepts(mapped)


@pytest.mark.parametrize("mechanism", ["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"])
def test_sasl_settings_map_to_librdkafkas(mechanism: str) -> None:
    settings = Settings(
        kafka_security_protocol="SASL_PLAINTEXT",
        kafka_sasl_mechanism=mechanism,
        kafka_sasl_username="alice",
        kafka_sasl_password="s3cret",
    )
    mapped = librdkafka_config(settings.kafka_client_config({"fetch_max_wait_ms": 5}))
    assert mapped == {
        "security.protocol": "SASL_PLAINTEXT",
        "sasl.mechanism": mechanism,
        "sasl.username": "alice",
        "sasl.password": "s3cret",
        "fetch.wait.max.ms": 5,
    }
    librdkafka_accepts(mapped)


def test_ssl_settings_map_to_librdkafkas() -> None:
    settings = Settings(kafka_security_protocol="SSL", kafka_ssl_cafile="/etc/ca.pem")
    assert librdkafka_config(settings.kafka_client_config()) == {
        "security.protocol": "SSL",
        "ssl.ca.location": "/etc/ca.pem",
    }
    client = {"ssl_certfile": "c.pem", "ssl_keyfile": "k.pem", "ssl_check_hostname": False}
    assert librdkafka_config(client) == {
        "ssl.certificate.location": "c.pem",
        "ssl.key.location": "k.pem",
        "ssl.endpoint.identification.algorithm": "none",
    }


def test_a_setting_librdkafka_lacks_is_refused_naming_it_and_the_reader() -> None:
    with pytest.raises(ConfigError) as err:
        librdkafka_config({"fetch_max_wait_ms": 5, "ssl_context": object(), "api_version": (3,)})
    message = str(err.value)
    assert "['api_version', 'ssl_context']" in message and "reader='confluent'" in message


def test_fixed_settings_may_not_change() -> None:
    assert librdkafka_config({"isolation_level": "read_committed"}) == {}
    with pytest.raises(ConfigError, match="may not change"):
        librdkafka_config({"isolation_level": "read_uncommitted"})


def test_a_confluent_source_refuses_unmapped_tunables_when_built() -> None:
    with pytest.raises(ConfigError) as err:
        KafkaSource(topics=("t",), reader="confluent", consumer_config={"max_poll_records": 9})
    message = str(err.value)
    assert "KafkaSource of ['t']" in message and "'max_poll_records'" in message
    assert "reader='confluent'" in message
    # The other readers take it; confluent takes what librdkafka has.
    assert KafkaSource(topics=("t",), reader="python", consumer_config={"max_poll_records": 9})
    source = KafkaSource(topics=("t",), reader="confluent", consumer_config={"client_id": "x"})
    assert source.reader == "confluent" and source.consumer_config == {"client_id": "x"}


def test_an_unknown_reader_names_confluent_among_the_choices() -> None:
    with pytest.raises(ConfigError, match="'confluent'"):
        KafkaSource(topics=("t",), reader="librdkafka")  # type: ignore[arg-type]
