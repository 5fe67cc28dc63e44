"""Object store on S3 (SeaweedFS locally, MinIO or AWS S3 in production) via boto3.

Exclusive create is ``PutObject`` with ``If-None-Match: *``: the server answers 412 when
the key exists, which is what makes a manifest write a commit point. Throttling and 5xx
answers (and dropped connections) are retried here with capped exponential backoff and
full jitter — botocore's own retries are switched off so there is one policy, visible
and testable. A retried create that meets 412 may be meeting *its own* earlier write
(the first answer was lost); it then compares the stored bytes and succeeds if they
are its own. Every error names the bucket and the full key.
"""

from __future__ import annotations

import functools
import logging
import os
import random
import time
from collections.abc import Callable
from typing import Any, TypeVar

from microbatch.errors import StorageError
from microbatch.settings import Settings
from microbatch.storage.base import (
    AlreadyExistsError,
    ObjectNotFoundError,
    PreconditionFailedError,
    check_key,
    check_range,
)

log = logging.getLogger(__name__)
T = TypeVar("T")

_THROTTLE_CODES = frozenset(
    {
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "RequestLimitExceeded",
        "TooManyRequests",
        "RequestThrottled",
        "ConditionalRequestConflict",  # AWS: a concurrent conditional write; retry advised
    }
)
_NOT_FOUND_CODES = frozenset({"NoSuchKey", "404", "NotFound"})
_IF_MATCH = frozenset({"replace", "delete_if"})  # conditional on the object's ETag


def _status(err: Exception) -> int:
    resp = getattr(err, "response", None) or {}
    return int(resp.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)


def _code(err: Exception) -> str:
    resp = getattr(err, "response", None) or {}
    return str(resp.get("Error", {}).get("Code", ""))


def is_retryable(err: Exception) -> bool:
    """Throttling, 409 conflicts of conditional writes, 5xx and connection failures."""
    from botocore.exceptions import ClientError, ConnectionError, HTTPClientError

    if isinstance(err, ClientError):
        status = _status(err)
        return status >= 500 or status in (409, 429) or _code(err) in _THROTTLE_CODES
    return isinstance(err, ConnectionError | HTTPClientError)


def client_for(settings: Settings) -> Any:
    """The shared boto3 S3 client for ``settings`` (see :func:`shared_client`). Without
    keys in the settings, boto3's default credential chain supplies them; the AWS
    variables it reads are part of the client's identity, so changing them (a test, a
    rotated profile) gets a client that uses the new ones."""
    return shared_client(os.getpid(), settings.s3_client_key())


@functools.lru_cache(maxsize=8)
def shared_client(pid: int, identity: tuple[tuple[str, Any], ...]) -> Any:
    """One boto3 client per process and endpoint/credentials: creating one costs ~0.15 s
    (it loads the service model), and a batch opens several stores. Clients are
    thread-safe; ``pid`` keeps a forked process from reusing its parent's connections.
    ``identity``: :meth:`Settings.s3_client_key` (the client's kwargs come first)."""
    import boto3
    from botocore.config import Config

    config = Config(retries={"total_max_attempts": 1}, max_pool_connections=32)
    kwargs = {k: v for k, v in identity if not k.startswith("AWS_")}
    # A session of its own: boto3's default one keeps the profile and config files it read
    # first, and would miss a profile chosen since.
    return boto3.session.Session().client("s3", config=config, **kwargs)


def _is_credentials_error(err: Exception) -> bool:
    """No credentials found, or credentials the store does not accept."""
    from botocore.exceptions import ClientError, NoCredentialsError, PartialCredentialsError

    from microbatch.errors import S3_CREDENTIAL_CODES

    if isinstance(err, NoCredentialsError | PartialCredentialsError):
        return True
    return isinstance(err, ClientError) and _code(err) in S3_CREDENTIAL_CODES


class S3Store:
    """Objects under ``s3://bucket/prefix``; keys are relative to the prefix.

    ``client`` may be injected (tests use a fake that fails on purpose); ``sleep`` is the
    backoff clock.
    """

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        settings: Settings | None = None,
        *,
        client: Any = None,
        max_attempts: int = 6,
        base_delay: float = 0.05,
        max_delay: float = 2.0,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        if len(bucket) < 3:
            raise StorageError(f"S3 bucket names need 3+ characters, got {bucket!r}")
        self.bucket = bucket
        self.prefix = prefix.strip("/") + "/" if prefix.strip("/") else ""
        self.url = f"s3://{bucket}/{self.prefix}".rstrip("/")
        self.max_attempts = max_attempts
        self.base_delay = base_delay
        self.max_delay = max_delay
        self._sleep = sleep
        if client is None:
            settings = settings or Settings.from_env()
            client = client_for(settings)
        self.client = client
        #: For messages: where the credentials come from (never the keys), the endpoint.
        self.credentials = (
            "the injected client" if settings is None else (settings.s3_credentials_source)
        )
        self.endpoint = "S3" if settings is None else settings.s3_endpoint_url or "AWS S3"

    def __repr__(self) -> str:
        return f"S3Store({self.url!r})"

    def _full(self, key: str) -> str:
        return self.prefix + check_key(key)

    def _where(self, key: str) -> str:
        return f"s3://{self.bucket}/{self.prefix}{key}"

    def _call(self, op: str, key: str, fn: Callable[[], T]) -> T:
        """Run ``fn`` with retries; map the final failure to a StorageError naming the key."""
        from botocore.exceptions import BotoCoreError, ClientError

        attempt = 0
        while True:
            attempt += 1
            try:
                return fn()
            except (ClientError, BotoCoreError) as e:
                if attempt < self.max_attempts and is_retryable(e):
                    delay = random.uniform(0, min(self.max_delay, self.base_delay * 2**attempt))
                    log.warning(
                        "S3 %s %s: %s; retry %d in %.3fs", op, self._where(key), e, attempt, delay
                    )
                    self._sleep(delay)
                    continue
                if (
                    isinstance(e, ClientError)
                    and op not in _IF_MATCH
                    and (_status(e) == 404 or _code(e) in _NOT_FOUND_CODES)
                ):
                    raise ObjectNotFoundError(f"{self._where(key)} does not exist") from None
                if isinstance(e, ClientError) and _status(e) == 412 and op == "create":
                    raise AlreadyExistsError(f"{self._where(key)} already exists") from None
                if isinstance(e, ClientError) and _status(e) in (404, 412) and op in _IF_MATCH:
                    raise PreconditionFailedError(
                        f"{self._where(key)} changed or is gone (If-Match failed)"
                    ) from None
                if _is_credentials_error(e):
                    raise StorageError(
                        f"S3 {op} of {self._where(key)} at {self.endpoint}: the credentials "
                        f"were refused or not found ({e}). They came from {self.credentials}. "
                        "Set MICROBATCH_S3_ACCESS_KEY_ID and MICROBATCH_S3_SECRET_ACCESS_KEY "
                        "(or the microbatch_s3 connection's login/password), or unset them "
                        "and give the AWS default chain valid ones (AWS_ACCESS_KEY_ID / "
                        "AWS_SECRET_ACCESS_KEY, AWS_PROFILE, an instance profile)."
                    ) from e
                raise StorageError(
                    f"S3 {op} of key {self.prefix}{key!s} in bucket {self.bucket!r} failed "
                    f"after {attempt} attempt(s): {e}"
                ) from e

    def put(self, key: str, data: bytes) -> None:
        full = self._full(key)
        self._call(
            "put", key, lambda: self.client.put_object(Bucket=self.bucket, Key=full, Body=data)
        )

    def create(self, key: str, data: bytes) -> None:
        full = self._full(key)
        state = {"tries": 0}

        def attempt() -> None:
            state["tries"] += 1
            self.client.put_object(Bucket=self.bucket, Key=full, Body=data, IfNoneMatch="*")

        try:
            self._call("create", key, attempt)
        except AlreadyExistsError:
            # An earlier attempt may have succeeded with its answer lost: if the stored
            # object is byte-for-byte ours, the create did happen, exactly once.
            if state["tries"] > 1 and self.get(key) == data:
                return
            raise

    def get(self, key: str) -> bytes:
        full = self._full(key)

        def fetch() -> bytes:
            return self.client.get_object(Bucket=self.bucket, Key=full)["Body"].read()

        return self._call("get", key, fetch)

    def get_range(self, key: str, start: int, length: int) -> bytes:
        check_range(key, start, length)
        full = self._full(key)
        if length == 0:
            return b""

        def fetch() -> bytes:
            from botocore.exceptions import ClientError

            try:
                resp = self.client.get_object(
                    Bucket=self.bucket, Key=full, Range=f"bytes={start}-{start + length - 1}"
                )
            except ClientError as e:
                if _status(e) == 416:  # start beyond the end: an empty slice, as locally
                    return b""
                raise
            return resp["Body"].read()

        return self._call("get_range", key, fetch)

    def list(self, prefix: str) -> list[str]:
        full_prefix = self.prefix + prefix

        def fetch() -> list[str]:
            keys: list[str] = []
            paginator = self.client.get_paginator("list_objects_v2")
            for page in paginator.paginate(Bucket=self.bucket, Prefix=full_prefix):
                keys.extend(obj["Key"][len(self.prefix) :] for obj in page.get("Contents", []))
            return keys

        return sorted(self._call("list", prefix or "", fetch))

    def delete(self, key: str) -> None:
        full = self._full(key)
        try:
            self._call(
                "delete", key, lambda: self.client.delete_object(Bucket=self.bucket, Key=full)
            )
        except ObjectNotFoundError:
            return

    def exists(self, key: str) -> bool:
        full = self._full(key)
        try:
            self._call("exists", key, lambda: self.client.head_object(Bucket=self.bucket, Key=full))
        except ObjectNotFoundError:
            return False
        return True

    def get_tagged(self, key: str) -> tuple[bytes, str]:
        full = self._full(key)

        def fetch() -> tuple[bytes, str]:
            resp = self.client.get_object(Bucket=self.bucket, Key=full)
            return resp["Body"].read(), resp["ETag"]

        return self._call("get", key, fetch)

    def replace(self, key: str, data: bytes, tag: str) -> str:
        full = self._full(key)
        tries = 0

        def attempt() -> str:
            nonlocal tries
            tries += 1
            resp = self.client.put_object(Bucket=self.bucket, Key=full, Body=data, IfMatch=tag)
            return resp["ETag"]

        try:
            return self._call("replace", key, attempt)
        except PreconditionFailedError:
            # A retried write whose first answer was lost: is the stored object ours?
            if tries > 1:
                try:
                    stored, stored_tag = self.get_tagged(key)
                except ObjectNotFoundError:
                    raise PreconditionFailedError(f"{self._where(key)} is gone") from None
                if stored == data:
                    return stored_tag
            raise

    def delete_if(self, key: str, tag: str) -> None:
        full = self._full(key)
        try:
            self._call(
                "delete_if",
                key,
                lambda: self.client.delete_object(Bucket=self.bucket, Key=full, IfMatch=tag),
            )
        except PreconditionFailedError:
            if self.exists(key):  # changed; gone (a retried delete that did happen) is fine
                raise
