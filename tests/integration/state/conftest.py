"""A counting object store per test, on the local filesystem and on SeaweedFS."""

from __future__ import annotations

import uuid

import pytest

from microbatch.storage import LocalFileStore, S3Store
from microbatch.storage.counting import CountingStore


@pytest.fixture(params=["local", pytest.param("s3", marks=pytest.mark.integration)])
def store(request, tmp_path) -> CountingStore:
    if request.param == "local":
        return CountingStore(LocalFileStore(tmp_path / "store"))
    settings = request.getfixturevalue("s3_settings")
    return CountingStore(S3Store(settings.s3_bucket, f"state-it/{uuid.uuid4().hex}", settings))
