"""Settings precedence, validation and secret masking."""

from __future__ import annotations

import re

import pytest

from microbatch import ConfigError, Settings


def test_defaults_describe_the_embedded_local_stack():
    settings = Settings.from_env(env={})

    assert settings.kafka_bootstrap_servers == "127.0.0.1:9092"
    assert settings.s3_endpoint_url == "http://127.0.0.1:8333"
    assert settings.spark_master == "local[*]"


def test_environment_overrides_default_and_argument_overrides_environment():
    env = {"MICROBATCH_S3_BUCKET": "from-env", "MICROBATCH_SPARK_MASTER": "spark://h:7077"}

    settings = Settings.from_env(env=env, s3_bucket="from-arg")

    assert settings.s3_bucket == "from-arg"
    assert settings.spark_master == "spark://h:7077"


def test_empty_endpoint_means_the_aws_default_endpoint():
    settings = Settings.from_env(env={"MICROBATCH_S3_ENDPOINT_URL": ""})

    assert "endpoint_url" not in settings.boto3_client_kwargs()
    assert "endpoint_override" not in settings.pyarrow_s3_kwargs()


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        ("MICROBATCH_KAFKA_BOOTSTRAP_SERVERS", "broker-without-port", "expected host:port"),
        ("MICROBATCH_S3_ENDPOINT_URL", "ftp://x", r"http\(s\)://"),
        ("MICROBATCH_S3_BUCKET", "ab", r"3\+ characters"),
        ("MICROBATCH_KAFKA_TIMEOUT_S", "0", "more than 0"),
        ("MICROBATCH_KAFKA_TIMEOUT_S", "soon", "expected seconds"),
    ],
)
def test_invalid_value_is_rejected_with_the_variable_and_value(name, value, message):
    with pytest.raises(ConfigError, match=message) as err:
        Settings.from_env(env={name: value})

    assert name in str(err.value)


def test_unknown_override_is_an_error_naming_it():
    with pytest.raises(ConfigError, match="kafka_servers"):
        Settings.from_env(env={}, kafka_servers="x:1")


def test_secret_never_appears_in_repr_or_redacted_form():
    settings = Settings.from_env(env={"MICROBATCH_S3_SECRET_ACCESS_KEY": "hunter2-secret"})

    assert "hunter2-secret" not in repr(settings)
    assert "hunter2-secret" not in str(settings.redacted())
    assert settings.to_env()["MICROBATCH_S3_SECRET_ACCESS_KEY"] == "hunter2-secret"


def test_plaintext_kafka_needs_no_client_settings():
    assert Settings.from_env(env={}).kafka_client_config() == {}


def test_sasl_kafka_settings_become_kafka_python_client_settings():
    settings = Settings.from_env(
        env={
            "MICROBATCH_KAFKA_SECURITY_PROTOCOL": "SASL_SSL",
            "MICROBATCH_KAFKA_SASL_MECHANISM": "SCRAM-SHA-512",
            "MICROBATCH_KAFKA_SASL_USERNAME": "etl",
            "MICROBATCH_KAFKA_SASL_PASSWORD": "s3cret-pw",
            "MICROBATCH_KAFKA_SSL_CAFILE": "/etc/ssl/kafka-ca.pem",
        }
    )

    assert settings.kafka_client_config() == {
        "security_protocol": "SASL_SSL",
        "sasl_mechanism": "SCRAM-SHA-512",
        "sasl_plain_username": "etl",
        "sasl_plain_password": "s3cret-pw",
        "ssl_cafile": "/etc/ssl/kafka-ca.pem",
    }
    assert "s3cret-pw" not in repr(settings)
    assert "s3cret-pw" not in str(settings.redacted())


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"MICROBATCH_KAFKA_SECURITY_PROTOCOL": "TLS"}, "expected one of PLAINTEXT, SSL"),
        (
            {"MICROBATCH_KAFKA_SECURITY_PROTOCOL": "SASL_PLAINTEXT"},
            "needs MICROBATCH_KAFKA_SASL_USERNAME and MICROBATCH_KAFKA_SASL_PASSWORD",
        ),
        (
            {
                "MICROBATCH_KAFKA_SECURITY_PROTOCOL": "SASL_SSL",
                "MICROBATCH_KAFKA_SASL_MECHANISM": "GSSAPI",
                "MICROBATCH_KAFKA_SASL_USERNAME": "etl",
                "MICROBATCH_KAFKA_SASL_PASSWORD": "pw",
            },
            "MICROBATCH_KAFKA_SASL_MECHANISM='GSSAPI': expected one of PLAIN, SCRAM-SHA-256",
        ),
    ],
)
def test_incomplete_or_unknown_kafka_security_settings_are_refused(env, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        Settings.from_env(env=env)


def test_the_planners_broker_timeout_comes_from_the_settings():
    from microbatch.kafka.planner import KafkaBrokerView

    class Seen(KafkaBrokerView):  # records what it would connect with, connects to nothing
        def __init__(self, servers, timeout_s, client_config=None):
            self.seen = (servers, timeout_s)

    settings = Settings.from_env(env={"MICROBATCH_KAFKA_TIMEOUT_S": "2.5"})

    assert settings.kafka_timeout_s == 2.5
    assert Seen.for_settings(settings).seen == ("127.0.0.1:9092", 2.5)
    assert Seen.for_settings(settings, timeout_s=7).seen[1] == 7
    assert Settings.from_env(env={}).kafka_timeout_s == 30.0
