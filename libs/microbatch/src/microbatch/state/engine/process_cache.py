"""The block cache a process keeps between batches, one per checkpoint store.

Runs are immutable, so what a Spark Python worker fetched for one batch is still valid
for the next: the cache lives as long as the worker (Spark reuses Python workers between
tasks) and keeps decoded blocks in memory within ``state_cache_memory_mb``, raw blocks in
``state_cache_dir`` on local disk. The object store stays the truth; a new worker, another
machine or a deleted folder only means fetching again.

The folder is kept within ``state_cache_disk_mb``: once a process has written a tenth of
that since it last looked, it measures the folder and deletes the runs fetched least
recently (whole run folders, oldest modification first) down to 80 % of the budget. A
reader that loses a file to a trim in another process simply fetches it again.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from microbatch.settings import Settings
from microbatch.state.engine.blockcache import BlockCache
from microbatch.storage import ObjectStore

#: ``state_cache_dir`` values that keep no blocks on local disk.
NO_DISK = ("off", "none")
_caches: dict[tuple[str, str, int], BlockCache] = {}
#: Bytes each cache had written to disk when its folder was last measured.
_measured_at: dict[int, int] = {}


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
    limit = settings.state_cache_disk_mb << 20
    if directory is not None and cache.disk_bytes - _measured_at.get(id(cache), 0) >= limit // 10:
        _measured_at[id(cache)] = cache.disk_bytes
        trim(directory, limit)
    return cache


def trim(directory: Path, limit: int) -> int:
    """Delete the least recently fetched runs' folders until ``directory`` holds at most
    80 % of ``limit`` bytes (nothing if it holds at most ``limit``); returns bytes freed."""
    runs = []
    total = 0
    for shard in _entries(directory):
        for run in _entries(Path(shard.path)):
            size, newest = 0, 0.0
            for part in _entries(Path(run.path)):
                try:
                    stat = part.stat()
                except FileNotFoundError:
                    continue
                size += stat.st_size
                newest = max(newest, stat.st_mtime)
            runs.append((newest, size, run.path))
            total += size
    if total <= limit:
        return 0
    freed = 0
    for _, size, path in sorted(runs):
        if total - freed <= limit * 0.8:
            break
        shutil.rmtree(path, ignore_errors=True)
        freed += size
    return freed


def _entries(folder: Path) -> list[os.DirEntry[str]]:
    try:
        with os.scandir(folder) as it:
            return [e for e in it if e.is_dir() or e.is_file()]
    except (FileNotFoundError, NotADirectoryError):
        return []
