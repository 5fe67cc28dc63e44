"""S3Store's retry policy and error mapping, against a fake boto3 client (no service)."""

from __future__ import annotations

import io

import pytest
from botocore.exceptions import ClientError

from microbatch.errors import StorageError
from microbatch.storage import AlreadyExistsError, ObjectNotFoundError, S3Store, open_store
from microbatch.storage.local import LocalFileStore


def _err(status: int, code: str) -> ClientError:
    return ClientError(
        {"Error": {"Code": code, "Message": code}, "ResponseMetadata": {"HTTPStatusCode": status}},
        "PutObject",
    )


class FakeClient:
    """Fails the first ``fail`` calls with ``error``, then behaves like a tiny S3."""

    def __init__(self, errors: list[ClientError]) -> None:
        self.errors = list(errors)
        self.objects: dict[str, bytes] = {}
        self.calls = 0

    def _maybe_fail(self) -> None:
        self.calls += 1
        if self.errors:
            raise self.errors.pop(0)

    def put_object(self, Bucket, Key, Body, IfNoneMatch=None):
        self._maybe_fail()
        if IfNoneMatch == "*" and Key in self.objects:
            raise _err(412, "PreconditionFailed")
        self.objects[Key] = Body

    def get_object(self, Bucket, Key, Range=None):
        self._maybe_fail()
        if Key not in self.objects:
            raise _err(404, "NoSuchKey")
        return {"Body": io.BytesIO(self.objects[Key])}


def _store(client: FakeClient, sleeps: list[float]) -> S3Store:
    return S3Store("bucket", "pre", client=client, sleep=sleeps.append, max_attempts=4)


def test_put_retries_throttling_and_5xx_then_succeeds():
    client = FakeClient([_err(503, "SlowDown"), _err(500, "InternalError")])
    sleeps: list[float] = []
    _store(client, sleeps).put("k", b"v")
    assert client.objects == {"pre/k": b"v"}
    assert len(sleeps) == 2 and all(s >= 0 for s in sleeps)


def test_put_gives_up_after_max_attempts_naming_bucket_and_key():
    client = FakeClient([_err(503, "SlowDown")] * 10)
    sleeps: list[float] = []
    with pytest.raises(StorageError, match=r"pre/k.*'bucket'.*4 attempt"):
        _store(client, sleeps).put("k", b"v")
    assert client.calls == 4


def test_client_error_4xx_is_not_retried():
    client = FakeClient([_err(403, "AccessDenied")])
    with pytest.raises(StorageError, match="AccessDenied"):
        _store(client, []).put("k", b"v")
    assert client.calls == 1


def test_get_missing_maps_to_not_found_naming_url():
    with pytest.raises(ObjectNotFoundError, match="s3://bucket/pre/nope"):
        _store(FakeClient([]), []).get("nope")


def test_create_whose_first_answer_was_lost_succeeds_once():
    # First attempt "fails" with a 500 *after* writing (simulated by pre-seeding on retry).
    client = FakeClient([])
    original = client.put_object
    state = {"n": 0}

    def lossy_put(**kwargs):
        state["n"] += 1
        original(**kwargs)
        if state["n"] == 1:
            raise _err(500, "InternalError")

    client.put_object = lossy_put
    _store(client, []).create("m", b"mine")
    assert client.objects["pre/m"] == b"mine"


def test_create_meeting_someone_elses_object_after_retry_raises():
    client = FakeClient([_err(503, "SlowDown")])
    client.objects["pre/m"] = b"theirs"
    with pytest.raises(AlreadyExistsError):
        _store(client, []).create("m", b"mine")


def test_open_store_plain_path_is_local(tmp_path):
    assert isinstance(open_store(str(tmp_path)), LocalFileStore)
