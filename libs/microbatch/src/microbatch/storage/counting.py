"""A wrapper that counts requests and bytes, for benchmarks and "bytes read" tests."""

from __future__ import annotations

import threading
from collections import Counter

from microbatch.storage.base import ObjectStore


class CountingStore:
    """Delegates to ``inner``; ``requests[op]`` and ``bytes_read``/``bytes_written`` grow."""

    def __init__(self, inner: ObjectStore) -> None:
        self.inner = inner
        self.url = inner.url
        self.requests: Counter[str] = Counter()
        self.bytes_read = 0
        self.bytes_written = 0
        self._lock = threading.Lock()

    def reset(self) -> None:
        with self._lock:
            self.requests.clear()
            self.bytes_read = self.bytes_written = 0

    def _count(self, op: str, read: int = 0, written: int = 0) -> None:
        with self._lock:
            self.requests[op] += 1
            self.bytes_read += read
            self.bytes_written += written

    def put(self, key: str, data: bytes) -> None:
        self.inner.put(key, data)
        self._count("put", written=len(data))

    def create(self, key: str, data: bytes) -> None:
        self.inner.create(key, data)
        self._count("create", written=len(data))

    def get(self, key: str) -> bytes:
        data = self.inner.get(key)
        self._count("get", read=len(data))
        return data

    def get_range(self, key: str, start: int, length: int) -> bytes:
        data = self.inner.get_range(key, start, length)
        self._count("get_range", read=len(data))
        return data

    def list(self, prefix: str) -> list[str]:
        self._count("list")
        return self.inner.list(prefix)

    def delete(self, key: str) -> None:
        self._count("delete")
        self.inner.delete(key)

    def exists(self, key: str) -> bool:
        self._count("exists")
        return self.inner.exists(key)

    def get_tagged(self, key: str) -> tuple[bytes, str]:
        data, tag = self.inner.get_tagged(key)
        self._count("get", read=len(data))
        return data, tag

    def replace(self, key: str, data: bytes, tag: str) -> str:
        new_tag = self.inner.replace(key, data, tag)
        self._count("replace", written=len(data))
        return new_tag

    def delete_if(self, key: str, tag: str) -> None:
        self._count("delete")
        self.inner.delete_if(key, tag)
