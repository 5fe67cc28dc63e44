"""Which connections the native reader takes, and how it says why not (no broker needed:
the reads themselves are pinned against a real broker in
``tests/integration/kafka/test_librdkafka_readers.py``)."""

from __future__ import annotations

import pytest

from microbatch.errors import ConfigError
from microbatch.kafka.native_reader import check_native, native_problem


def test_plain_and_sasl_plain_connections_are_the_native_readers():
    assert native_problem(None) is None
    assert native_problem({"fetch_max_wait_ms": 10}) is None
    sasl_plain = {
        "security_protocol": "SASL_PLAINTEXT",
        "sasl_mechanism": "PLAIN",
        "sasl_plain_username": "u",
        "sasl_plain_password": "p",
    }
    assert native_problem(sasl_plain) is None


@pytest.mark.parametrize(
    ("config", "named"),
    [
        ({"security_protocol": "SSL"}, "SSL"),
        ({"security_protocol": "SASL_SSL", "sasl_mechanism": "PLAIN"}, "SASL_SSL"),
        ({"security_protocol": "SASL_PLAINTEXT", "sasl_mechanism": "SCRAM-SHA-512"}, "SCRAM"),
    ],
)
def test_tls_and_scram_are_left_to_confluent_kafka_saying_so(config, named):
    with pytest.raises(ConfigError) as err:
        check_native(config)
    message = str(err.value)
    assert named in message and "reader='confluent'" in message


def test_a_setting_librdkafka_lacks_is_refused_as_for_confluent_kafka():
    assert "max_poll_records" in str(native_problem({"max_poll_records": 10}))


def test_a_missing_extension_says_how_to_build_it(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "microbatch_native", None)  # import fails
    problem = native_problem(None)
    assert problem is not None
    assert "microbatch-native" in problem and "make setup" in problem
