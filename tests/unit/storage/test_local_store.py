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


def test_a_key_locked_by_a_stopped_process_fails_a_conditional_write_instead_of_hanging(
    tmp_path: Path,
) -> None:
    """A process frozen (SIGSTOP) while holding a key's lock blocked every other writer
    of the key forever; the wait now ends in a StorageError naming the lock file."""
    import os
    import signal
    import subprocess
    import sys

    store = LocalFileStore(tmp_path)
    store.create("lease", b"v1")
    _, tag = store.get_tagged("lease")
    holder = subprocess.Popen(
        [sys.executable, "-c",
         "import os, signal, sys\n"
         "from microbatch.storage import LocalFileStore\n"
         f"store = LocalFileStore({str(tmp_path)!r})\n"
         "with store._locked('lease'):\n"
         "    print('locked', flush=True)\n"
         "    os.kill(os.getpid(), signal.SIGSTOP)\n"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "locked\n"
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(local_store, "LOCK_WAIT_S", 0.3)
            with pytest.raises(StorageError, match=r"held .*lock-.* for over 0 s"):
                store.replace("lease", b"v2", tag)
        assert store.get("lease") == b"v1"
    finally:
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait()
    assert store.replace("lease", b"v2", tag)  # the lock died with its holder


def test_the_pause_hook_stops_no_thread_inside_a_key_lock(tmp_path: Path) -> None:
    """The crash tests' pause stops the whole process: while it holds ``no_lock_held``,
    no other thread of the process (a lease renewal) can be inside a key's lock — else a
    paused zombie would block the run taking over from it."""
    import threading

    store = LocalFileStore(tmp_path)
    store.create("lease", b"v1")
    _, tag = store.get_tagged("lease")
    renewal = threading.Thread(target=store.replace, args=("lease", b"v2", tag))
    with local_store.no_lock_held():
        renewal.start()
        renewal.join(0.3)
        assert renewal.is_alive() and store.get("lease") == b"v1"
    renewal.join(5)
    assert store.get("lease") == b"v2"
