"""S3 credentials from AWS's default chain, against the run's real SeaweedFS.

SeaweedFS accepts only the local stack's keys (``microbatch`` / ``microbatch-secret``):
each test hands them over one way — or wrong ones — with the settings' keys unset, and
checks both S3 clients of the library (boto3 for the store, pyarrow's ``S3FileSystem``).
"""

from __future__ import annotations

import uuid

import pytest

from microbatch.errors import ExitCode, StorageError, exit_code
from microbatch.settings import AWS_CREDENTIAL_VARIABLES, LOCAL_STACK_S3_KEYS, Settings
from microbatch.storage.s3 import S3Store

pytestmark = pytest.mark.integration

ACCESS, SECRET = LOCAL_STACK_S3_KEYS


@pytest.fixture
def no_credentials(monkeypatch, tmp_path, s3_settings) -> Settings:
    """A clean slate: no keys in the settings or in any AWS variable; the real endpoint."""
    for name in (
        *AWS_CREDENTIAL_VARIABLES,
        "AWS_SECRET_ACCESS_KEY",
        "AWS_SESSION_TOKEN",
        "MICROBATCH_S3_ACCESS_KEY_ID",
        "MICROBATCH_S3_SECRET_ACCESS_KEY",
    ):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # no instance-profile probe
    return s3_settings


def chain_settings(s3_settings: Settings) -> Settings:
    """Settings as a job builds them from this environment, keys unset."""
    return Settings.from_env(
        s3_endpoint_url=s3_settings.s3_endpoint_url,
        s3_region=s3_settings.s3_region,
        s3_bucket=s3_settings.s3_bucket,
    )


def round_trip(settings: Settings) -> None:
    """Write and read back through both clients: the store (boto3) and pyarrow."""
    import pyarrow.fs as pafs

    prefix = f"credentials-{uuid.uuid4().hex[:8]}"
    store = S3Store(settings.s3_bucket, prefix, settings)
    store.put("a", b"through boto3")
    assert store.get("a") == b"through boto3"
    fs = pafs.S3FileSystem(**settings.pyarrow_s3_kwargs())
    path = f"{settings.s3_bucket}/{prefix}/b"
    with fs.open_output_stream(path) as out:
        out.write(b"through pyarrow")
    with fs.open_input_stream(path) as stream:
        assert stream.read() == b"through pyarrow"


def test_keys_only_in_the_aws_environment_variables_are_used(no_credentials, monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", ACCESS)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)

    settings = chain_settings(no_credentials)

    assert (settings.s3_access_key_id, settings.s3_secret_access_key) == ("", "")
    assert "aws_access_key_id" not in settings.boto3_client_kwargs()
    round_trip(settings)


def test_keys_only_in_a_shared_credentials_profile_are_used(no_credentials, monkeypatch, tmp_path):
    credentials = tmp_path / "credentials"
    credentials.write_text(
        "[default]\naws_access_key_id = not-this-one\naws_secret_access_key = nor-this\n\n"
        f"[microbatch-test]\naws_access_key_id = {ACCESS}\naws_secret_access_key = {SECRET}\n"
    )
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(credentials))
    monkeypatch.setenv("AWS_PROFILE", "microbatch-test")

    settings = chain_settings(no_credentials)

    assert settings.s3_access_key_id == ""
    round_trip(settings)


def test_wrong_keys_from_the_chain_fail_with_a_message_that_says_where_they_came_from(
    no_credentials, monkeypatch
):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", ACCESS)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    settings = chain_settings(no_credentials)

    with pytest.raises(StorageError) as failed:
        S3Store(settings.s3_bucket, "credentials-wrong", settings).put("a", b"x")

    message = str(failed.value)
    assert "the credentials were refused or not found" in message
    assert "the AWS default credential chain" in message
    assert "MICROBATCH_S3_ACCESS_KEY_ID" in message  # what to do
    assert "not-the-secret" not in message
    assert exit_code(failed.value) is ExitCode.CONFIG_ERROR  # retrying cannot fix it


def test_wrong_keys_in_the_settings_name_the_variable(no_credentials):
    settings = Settings.from_env(
        s3_endpoint_url=no_credentials.s3_endpoint_url,
        s3_bucket=no_credentials.s3_bucket,
        s3_access_key_id=ACCESS,
        s3_secret_access_key="wrong-secret-value",
    )

    with pytest.raises(StorageError, match="MICROBATCH_S3_ACCESS_KEY_ID='microbatch'") as failed:
        S3Store(settings.s3_bucket, "credentials-wrong", settings).get("a")

    assert "wrong-secret-value" not in str(failed.value)


def test_without_any_aws_variable_a_loopback_endpoint_is_the_local_stack(no_credentials):
    settings = chain_settings(no_credentials)

    assert (settings.s3_access_key_id, settings.s3_secret_access_key) == LOCAL_STACK_S3_KEYS
    round_trip(settings)
