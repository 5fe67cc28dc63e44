"""Where S3 credentials come from, and what MICROBATCH_ENV=production refuses."""

from __future__ import annotations

import pytest

from microbatch import ConfigError, Settings
from microbatch.settings import LOCAL_STACK_S3_KEYS

REAL = {
    "MICROBATCH_S3_ENDPOINT_URL": "https://s3.eu-west-1.amazonaws.com",
    "MICROBATCH_KAFKA_BOOTSTRAP_SERVERS": "b1.internal:9092,b2.internal:9092",
}


def test_the_local_stack_gets_its_keys_when_nothing_else_names_credentials():
    settings = Settings.from_env(env={})  # loopback endpoint, no AWS variable

    assert (settings.s3_access_key_id, settings.s3_secret_access_key) == LOCAL_STACK_S3_KEYS
    assert settings.boto3_client_kwargs()["aws_access_key_id"] == "microbatch"


@pytest.mark.parametrize("variable", ["AWS_ACCESS_KEY_ID", "AWS_PROFILE"])
def test_an_aws_credential_variable_hands_the_local_endpoint_to_the_default_chain(variable):
    settings = Settings.from_env(env={variable: "from-the-chain"})

    assert settings.s3_access_key_id == settings.s3_secret_access_key == ""
    assert "aws_access_key_id" not in settings.boto3_client_kwargs()
    assert "access_key" not in settings.pyarrow_s3_kwargs()
    assert "default credential chain" in settings.s3_credentials_source


def test_a_real_endpoint_without_keys_never_falls_back_to_the_local_keys():
    settings = Settings.from_env(env={"MICROBATCH_S3_ENDPOINT_URL": ""})  # AWS

    assert settings.s3_access_key_id == settings.s3_secret_access_key == ""
    assert settings.boto3_client_kwargs() == {"region_name": "us-east-1"}
    assert settings.pyarrow_s3_kwargs() == {"region": "us-east-1"}
    assert settings.secret_values() == []


def test_explicit_keys_win_over_everything():
    env = {
        **REAL,
        "MICROBATCH_S3_ACCESS_KEY_ID": "AKIAEXAMPLE",
        "MICROBATCH_S3_SECRET_ACCESS_KEY": "s3cr3t-key",
        "AWS_PROFILE": "ignored",
    }

    kwargs = Settings.from_env(env=env).boto3_client_kwargs()

    assert kwargs["aws_access_key_id"] == "AKIAEXAMPLE"
    assert kwargs["aws_secret_access_key"] == "s3cr3t-key"


def test_half_a_key_pair_is_refused_naming_the_missing_half():
    with pytest.raises(ConfigError, match="MICROBATCH_S3_SECRET_ACCESS_KEY is not"):
        Settings.from_env(env={**REAL, "MICROBATCH_S3_ACCESS_KEY_ID": "AKIAEXAMPLE"})


def test_secret_values_are_every_secret_setting_that_is_set():
    settings = Settings.from_env(
        env={
            "MICROBATCH_KAFKA_SECURITY_PROTOCOL": "SASL_SSL",
            "MICROBATCH_KAFKA_SASL_USERNAME": "etl",
            "MICROBATCH_KAFKA_SASL_PASSWORD": "sasl-pw-123",
        }
    )

    assert sorted(settings.secret_values()) == ["microbatch-secret", "sasl-pw-123"]


def test_production_accepts_real_services_and_the_default_chain():
    settings = Settings.from_env(env={**REAL, "MICROBATCH_ENV": "production"})

    assert settings.s3_access_key_id == ""


@pytest.mark.parametrize(
    ("env", "named"),
    [
        ({}, "MICROBATCH_S3_ACCESS_KEY_ID / MICROBATCH_S3_SECRET_ACCESS_KEY"),
        ({"AWS_PROFILE": "prod"}, "MICROBATCH_S3_ENDPOINT_URL='http://127.0.0.1:8333'"),
        (
            {
                "MICROBATCH_S3_ENDPOINT_URL": "https://minio.internal",
                "MICROBATCH_S3_ACCESS_KEY_ID": "microbatch",
                "MICROBATCH_S3_SECRET_ACCESS_KEY": "microbatch-secret",
            },
            "the local stack's keys",
        ),
        (
            {
                "MICROBATCH_S3_ENDPOINT_URL": "",
                "MICROBATCH_KAFKA_BOOTSTRAP_SERVERS": "localhost:9092",
            },
            "MICROBATCH_KAFKA_BOOTSTRAP_SERVERS='localhost:9092'",
        ),
    ],
)
def test_production_refuses_the_local_stacks_defaults_naming_the_setting(env, named):
    with pytest.raises(ConfigError, match="refused with MICROBATCH_ENV=production") as refused:
        Settings.from_env(env={**env, "MICROBATCH_ENV": "production"})

    assert named in str(refused.value)
    assert "microbatch-secret" not in str(refused.value)


def test_an_unknown_environment_name_is_refused_rather_than_ignored():
    with pytest.raises(ConfigError, match="MICROBATCH_ENV='prod': expected one of development"):
        Settings.from_env(env={**REAL, "MICROBATCH_ENV": "prod"})
