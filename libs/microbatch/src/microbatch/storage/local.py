"""Object store on a local folder: the embedded default, same semantics as S3.

Atomicity comes from the filesystem: ``put`` writes a temporary file next to the target
and renames it over (readers never see half an object); ``create`` writes a temporary
file and hard-links it to the target, which fails if the target exists, so of many racing
writers exactly one wins and the winner's content is complete when it becomes visible.
The conditional ``replace``/``delete_if`` compare the content's MD5 (the tag, like S3's
ETag) under an exclusive ``flock`` per key, so they are atomic across processes. A
process frozen while holding one (SIGSTOP, a VM paused) would block every other writer of
the key: a waiter gives up after :data:`LOCK_WAIT_S` with a :class:`StorageError` naming
the lock file, instead of hanging.
Temporary and lock files carry a reserved name prefix and are never listed. Every rename
or link is followed by an fsync of its folder, so an object (a committed manifest) that a
call returned for survives a power loss.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

from microbatch.errors import StorageError
from microbatch.storage.base import (
    AlreadyExistsError,
    ObjectNotFoundError,
    PreconditionFailedError,
    check_key,
    check_range,
)

_TMP_PREFIX = ".mbtmp-"
#: How long a conditional write waits for another process's lock on its key (held for
#: milliseconds by a live writer) before failing.
LOCK_WAIT_S = 60.0
#: Held by a thread of this process while it holds a key's lock: :func:`no_lock_held`
#: lets the fault-injection pause stop the process only between such writes.
_HOLDING = threading.RLock()


@contextlib.contextmanager
def no_lock_held() -> Iterator[None]:
    """While inside, no thread of this process holds (or takes) a key's lock: the crash
    tests' pause (``runtime.faults.pause_if``) stops the process here, so a paused zombie
    stalls at its protocol point, not with a background thread's lease write half done."""
    with _HOLDING:
        yield


class LocalFileStore:
    """Objects are files under ``root``; keys map to relative paths."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root).expanduser().resolve()
        self.root.mkdir(parents=True, exist_ok=True)
        self.url = self.root.as_uri()

    def __repr__(self) -> str:
        return f"LocalFileStore({str(self.root)!r})"

    def _path(self, key: str) -> Path:
        check_key(key)
        if any(part.startswith(_TMP_PREFIX) for part in key.split("/")):
            raise StorageError(f"object key uses the reserved prefix {_TMP_PREFIX!r}: {key!r}")
        return self.root / key

    def _write_temp(self, path: Path, data: bytes) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.parent / f"{_TMP_PREFIX}{uuid.uuid4().hex}"
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        return tmp

    @staticmethod
    def _sync_dir(path: Path) -> None:
        """Make a rename or link into ``path``'s directory durable: without it, a power
        loss can forget an object (a committed manifest) whose bytes were synced."""
        fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def put(self, key: str, data: bytes) -> None:
        path = self._path(key)
        try:
            tmp = self._write_temp(path, data)
            os.replace(tmp, path)
            self._sync_dir(path)
        except OSError as e:
            raise StorageError(f"put {self.url}/{key} failed: {e}") from e

    def create(self, key: str, data: bytes) -> None:
        path = self._path(key)
        try:
            tmp = self._write_temp(path, data)
        except OSError as e:
            raise StorageError(f"create {self.url}/{key} failed: {e}") from e
        try:
            os.link(tmp, path)
            self._sync_dir(path)
        except FileExistsError:
            raise AlreadyExistsError(f"{self.url}/{key} already exists") from None
        except OSError as e:
            raise StorageError(f"create {self.url}/{key} failed: {e}") from e
        finally:
            tmp.unlink(missing_ok=True)

    def get(self, key: str) -> bytes:
        path = self._path(key)
        try:
            return path.read_bytes()
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            raise ObjectNotFoundError(f"{self.url}/{key} does not exist") from None
        except OSError as e:
            raise StorageError(f"get {self.url}/{key} failed: {e}") from e

    def get_range(self, key: str, start: int, length: int) -> bytes:
        check_range(key, start, length)
        path = self._path(key)
        try:
            with open(path, "rb") as f:
                f.seek(start)
                return f.read(length)
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            raise ObjectNotFoundError(f"{self.url}/{key} does not exist") from None
        except OSError as e:
            raise StorageError(f"get_range {self.url}/{key} failed: {e}") from e

    def list(self, prefix: str) -> list[str]:
        # Walk only the deepest folder the prefix names, then filter by string prefix.
        folder = prefix.rsplit("/", 1)[0] if "/" in prefix else ""
        base = self.root / folder if folder else self.root
        if not base.is_dir():
            return []
        keys = []
        for dirpath, _dirs, files in os.walk(base):
            rel_dir = Path(dirpath).relative_to(self.root).as_posix()
            for name in files:
                if name.startswith(_TMP_PREFIX):
                    continue
                key = name if rel_dir == "." else f"{rel_dir}/{name}"
                if key.startswith(prefix):
                    keys.append(key)
        return sorted(keys)

    def delete(self, key: str) -> None:
        path = self._path(key)
        try:
            path.unlink(missing_ok=True)
        except IsADirectoryError:
            return
        except OSError as e:
            raise StorageError(f"delete {self.url}/{key} failed: {e}") from e

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()

    def get_tagged(self, key: str) -> tuple[bytes, str]:
        data = self.get(key)
        return data, _tag(data)

    def replace(self, key: str, data: bytes, tag: str) -> str:
        path = self._path(key)
        with self._locked(key):
            try:
                self._check_tag(key, tag)
            except ObjectNotFoundError:
                raise PreconditionFailedError(f"{self.url}/{key} is gone") from None
            try:
                os.replace(self._write_temp(path, data), path)
                self._sync_dir(path)
            except OSError as e:
                raise StorageError(f"replace {self.url}/{key} failed: {e}") from e
        return _tag(data)

    def delete_if(self, key: str, tag: str) -> None:
        with self._locked(key):
            try:
                self._check_tag(key, tag)
            except ObjectNotFoundError:
                return
            self.delete(key)

    def _check_tag(self, key: str, tag: str) -> None:
        current = _tag(self.get(key))
        if current != tag:
            raise PreconditionFailedError(
                f"{self.url}/{key} changed: its tag is {current}, expected {tag}"
            )

    @contextlib.contextmanager
    def _locked(self, key: str) -> Iterator[None]:
        """An exclusive lock for ``key`` among every process using this folder. Failing to
        take it (no file descriptor left, a read-only folder) is a :class:`StorageError`
        like every other failure of this store, so callers that retry those retry it."""
        name = hashlib.md5(key.encode(), usedforsecurity=False).hexdigest()
        try:
            lock = open(self.root / f"{_TMP_PREFIX}lock-{name}", "a")  # noqa: SIM115
        except OSError as e:
            raise StorageError(f"locking {self.url}/{key} failed: {e}") from e
        with lock, _HOLDING:
            deadline = time.monotonic() + LOCK_WAIT_S
            while True:
                try:
                    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        raise StorageError(
                            f"locking {self.url}/{key} failed: another process has held "
                            f"{lock.name} for over {LOCK_WAIT_S:.0f} s (a stalled or "
                            "stopped process?); find it with `fuser` and end it"
                        ) from None
                    time.sleep(0.005)
                except OSError as e:
                    raise StorageError(f"locking {self.url}/{key} failed: {e}") from e
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)


def _tag(data: bytes) -> str:
    return hashlib.md5(data, usedforsecurity=False).hexdigest()
