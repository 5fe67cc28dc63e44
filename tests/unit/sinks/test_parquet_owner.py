"""A Parquet output belongs to the pipeline that first published to it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from microbatch.errors import ConfigError
from microbatch.sinks import parquet as ps
from microbatch.sinks.base import Staged
from microbatch.storage import LocalFileStore


@pytest.fixture
def store(tmp_path: Path) -> LocalFileStore:
    return LocalFileStore(tmp_path / "out")


def test_the_first_publish_claims_the_output_and_records_its_pipeline(store) -> None:
    assert ps.publish_parquet(store, 0, [Staged("batch=0/part-0.parquet", 2)], pipeline="counts")

    assert ps.owner_of(store) == "counts"
    assert json.loads(store.get(ps.commit_key(0)))["pipeline"] == "counts"
    assert not ps.publish_parquet(store, 0, [], pipeline="counts")  # a rerun: already visible


def test_an_entry_of_another_pipeline_is_never_taken_as_this_ones(store) -> None:
    """An output published by a version that claimed no owner: the entry still says who
    wrote it."""
    entry = {"batch": 0, "pipeline": "counts", "files": [], "rows": 0}
    store.create(ps.commit_key(0), json.dumps(entry).encode())

    with pytest.raises(ConfigError, match=r"'orders': .* belongs to pipeline 'counts'"):
        ps.publish_parquet(store, 0, [Staged("batch=0/part-0-x.parquet", 3)], pipeline="orders")
    with pytest.raises(ConfigError, match=r"'orders': .* belongs to pipeline 'counts'"):
        ps.publish_parquet(store, 1, [Staged("batch=1/part-0-x.parquet", 3)], pipeline="orders")
    assert ps.owner_of(store) is None  # nor does the refused pipeline claim it
