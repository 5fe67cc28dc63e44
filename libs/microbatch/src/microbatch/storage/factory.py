"""Turn a store URL into a backend, so settings and CLIs can name stores as strings."""

from __future__ import annotations

import os
from urllib.parse import unquote, urlparse

from microbatch.errors import StorageError
from microbatch.settings import Settings
from microbatch.storage.base import ObjectStore
from microbatch.storage.local import LocalFileStore
from microbatch.storage.s3 import S3Store


def open_store(url: str, settings: Settings | None = None) -> ObjectStore:
    """``file:///abs/dir`` or a plain path → :class:`LocalFileStore`;
    ``s3://bucket/prefix`` → :class:`S3Store` (endpoint and keys from ``settings``,
    default ``Settings.from_env()``; the bucket comes from the URL)."""
    if not url:
        raise StorageError("store URL is empty: give file:///dir, a path or s3://bucket/prefix")
    parsed = urlparse(url)
    if parsed.scheme == "s3":
        if not parsed.netloc:
            raise StorageError(f"store URL {url!r} has no bucket: expected s3://bucket/prefix")
        return S3Store(parsed.netloc, parsed.path.lstrip("/"), settings)
    if parsed.scheme == "file":
        if parsed.netloc not in ("", "localhost"):
            raise StorageError(f"store URL {url!r}: file URLs must be file:///absolute/dir")
        return LocalFileStore(unquote(parsed.path))
    if parsed.scheme and len(parsed.scheme) > 1:  # one letter: a Windows drive, a path
        raise StorageError(f"store URL {url!r}: unknown scheme {parsed.scheme!r} (file, s3)")
    return LocalFileStore(os.path.abspath(url))
