"""The local store's failures are StorageErrors, like those of S3: the lease's renewal
thread and every caller that retries storage failures rely on it."""

from __future__ import annotations

import builtins
import errno
from pathlib import Path
from typing import Any

import pytest

from microbatch.errors import StorageError
from microbatch.storage import LocalFileStore
from microbatch.storage import local as local_store


@pytest.fixture
def out_of_descriptors_for_locks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Opening a lock file fails as it does at the process's file-descriptor limit."""
    real_open = builtins.open

    def open_unless_a_lock(file: str | Path, *args: Any, **kwargs: Any) -> Any:
        if "lock-" in Path(file).name:
            raise OSError(errno.EMFILE, "Too many open files")
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(local_store, "open", open_unless_a_lock, raising=False)


def test_a_lock_that_cannot_be_opened_fails_a_conditional_write_as_a_storage_error(
    tmp_path: Path, out_of_descriptors_for_locks: None
) -> None:
    store = LocalFileStore(tmp_path / "store")
    store.put("lease.json", b"held")
    _, tag = store.get_tagged("lease.json")

    with pytest.raises(StorageError, match=r"locking .*/lease\.json failed: .*Too many open"):
        store.replace("lease.json", b"renewed", tag)
    with pytest.raises(StorageError, match=r"locking .*/lease\.json failed"):
        store.delete_if("lease.json", tag)
    assert store.get("lease.json") == b"held"
