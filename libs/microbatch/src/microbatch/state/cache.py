"""The block cache a process keeps between batches, one per checkpoint store.

Runs are immutable, so what a Spark Python worker fetched for one batch is still valid
for the next: the cache lives as long as the worker (Spark reuses Python workers between
tasks) and keeps decoded blocks in memory within ``state_cache_memory_mb``, raw blocks in
``state_cache_dir`` on local disk. The object store stays the truth; a new worker, another
machine or a deleted folder only means fetching again.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from microbatch.settings import Settings
from microbatch.state.blockcache import BlockCache
from microbatch.storage import ObjectStore

#: ``state_cache_dir`` values that keep no blocks on local disk.
NO_DISK = ("off", "none")
_caches: dict[tuple[str, str, int], BlockCache] = {}


def cache_directory(settings: Settings) -> Path | None:
    """Where raw blocks are kept: the setting, else a folder in the system's temp dir."""
    configured = settings.state_cache_dir.strip()
    if configured.lower() in NO_DISK:
        return None
    if configured:
        return Path(configured).expanduser()
    return Path(tempfile.gettempdir()) / "microbatch-state-cache"


def state_cache(store: ObjectStore, settings: Settings) -> BlockCache:
    """This process's cache for ``store`` (created on first use)."""
    directory = cache_directory(settings)
    memory = settings.state_cache_memory_mb << 20
    slot = (store.url, str(directory), memory)
    cache = _caches.get(slot)
    if cache is None:
        cache = _caches[slot] = BlockCache(store, directory, memory)
    cache.store = store  # this batch's client; the cached bytes do not depend on it
    return cache
