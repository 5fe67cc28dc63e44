"""The object-store contract every backend honours, and its two errors.

Checkpoints need only a handful of operations, so the contract is small enough to be
implemented identically on a local folder and on S3: whole-object put and get, an
*exclusive* create (the commit point of a checkpoint: exactly one racing writer wins),
ranged reads (a restore fetches only its own key-groups), prefix listing and delete — and,
for the pipeline's lease, a compare-and-swap: read an object with its *tag* (S3's ETag),
then replace or delete it only if the tag is unchanged (S3 ``If-Match``).

Keys are relative to the store's root, ``/``-separated, never absolute, without empty,
``.`` or ``..`` segments — so a key means the same thing on both backends.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from microbatch.errors import StorageError


class AlreadyExistsError(StorageError):
    """An exclusive create found the key already present (S3: HTTP 412)."""


class ObjectNotFoundError(StorageError):
    """The key does not exist."""


class PreconditionFailedError(StorageError):
    """A conditional replace or delete found the object changed or gone (S3: HTTP 412)."""


@runtime_checkable
class ObjectStore(Protocol):
    """What checkpoints need from storage; see the module docstring for key rules."""

    url: str

    def put(self, key: str, data: bytes) -> None:
        """Write ``data`` at ``key``, replacing any object; readers see old or new, never half."""

    def create(self, key: str, data: bytes) -> None:
        """Write ``data`` only if ``key`` is absent; else raise :class:`AlreadyExistsError`."""

    def get(self, key: str) -> bytes:
        """The whole object; :class:`ObjectNotFoundError` if absent."""

    def get_range(self, key: str, start: int, length: int) -> bytes:
        """``object[start:start + length]`` (shorter at the end of the object)."""

    def list(self, prefix: str) -> list[str]:
        """Every key starting with ``prefix`` (a plain string prefix), sorted."""

    def delete(self, key: str) -> None:
        """Remove ``key``; removing a missing key is not an error."""

    def exists(self, key: str) -> bool:
        """Whether ``key`` is present."""

    def get_tagged(self, key: str) -> tuple[bytes, str]:
        """The whole object and its tag, which changes whenever its content does."""

    def replace(self, key: str, data: bytes, tag: str) -> str:
        """Write ``data`` only if the object is still at ``tag``; its new tag. Else raise
        :class:`PreconditionFailedError` (also when the object is gone)."""

    def delete_if(self, key: str, tag: str) -> None:
        """Remove ``key`` only if it is still at ``tag``; else
        :class:`PreconditionFailedError` (a missing key is not an error)."""


def check_key(key: str) -> str:
    """Validate a key at the boundary so both backends reject the same bad keys."""
    if not isinstance(key, str) or not key:
        raise StorageError(f"object key must be a non-empty string, got {key!r}")
    if key.startswith("/") or "\\" in key:
        raise StorageError(f"object key must be relative and '/'-separated, got {key!r}")
    for part in key.split("/"):
        if part in ("", ".", ".."):
            raise StorageError(f"object key has an empty, '.' or '..' segment: {key!r}")
    return key


def check_range(key: str, start: int, length: int) -> None:
    if start < 0 or length < 0:
        raise StorageError(f"bad byte range for {key!r}: start={start}, length={length}")
