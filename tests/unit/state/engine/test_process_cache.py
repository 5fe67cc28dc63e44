"""The executors' state cache: one per store and settings per process, and a disk folder
kept within its budget by dropping the runs fetched least recently."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from microbatch.settings import Settings
from microbatch.state.engine.process_cache import cache_directory, state_cache, trim
from microbatch.storage import open_store


def run_folder(root: Path, name: str, size: int, mtime: float) -> Path:
    folder = root / name[:2] / name
    folder.mkdir(parents=True)
    for part in ("index", "0"):
        f = folder / part
        f.write_bytes(b"x" * (size // 2))
        os.utime(f, (mtime, mtime))
    return folder


def test_trim_drops_the_least_recently_fetched_runs_down_to_80_percent(tmp_path) -> None:
    old = run_folder(tmp_path, "aa01", 400, 1_000)
    middle = run_folder(tmp_path, "bb02", 400, 2_000)
    new = run_folder(tmp_path, "aa03", 400, 3_000)

    freed = trim(tmp_path, limit=1_000)

    assert freed == 400  # 1,200 bytes > 1,000: the oldest run brings it to 800
    assert not old.exists() and middle.exists() and new.exists()
    assert trim(tmp_path, limit=500) == 400  # 800 > 500: down to <= 400
    assert not middle.exists() and new.exists()


def test_trim_leaves_a_folder_within_its_budget_alone(tmp_path) -> None:
    kept = run_folder(tmp_path, "cc01", 400, 1_000)

    assert trim(tmp_path, limit=400) == 0
    assert kept.exists()
    assert trim(tmp_path / "missing", limit=0) == 0


def test_one_cache_per_store_and_folder_and_the_folder_setting(tmp_path) -> None:
    settings = dataclasses.replace(Settings.from_env(), state_cache_dir=str(tmp_path / "c"))
    store = open_store(str(tmp_path / "checkpoints"))

    first, again = state_cache(store, settings), state_cache(store, settings)
    other = state_cache(store, dataclasses.replace(settings, state_cache_dir="off"))

    assert first is again and other is not first
    assert first.directory == tmp_path / "c" and other.directory is None
    assert cache_directory(dataclasses.replace(settings, state_cache_dir="")).name == (
        "microbatch-state-cache"
    )


def test_a_cache_that_wrote_past_a_tenth_of_its_budget_trims_its_folder(tmp_path) -> None:
    settings = dataclasses.replace(
        Settings.from_env(), state_cache_dir=str(tmp_path / "c"), state_cache_disk_mb=1
    )
    store = open_store(str(tmp_path / "checkpoints"))
    cache = state_cache(store, settings)
    stale = run_folder(tmp_path / "c", "dd01", 2 << 20, 1_000)  # 2 MiB > the 1 MiB budget
    cache.disk_bytes += 200 << 10  # as if it had fetched 200 KiB since

    state_cache(store, settings)

    assert not stale.exists()
