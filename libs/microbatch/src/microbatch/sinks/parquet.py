"""Exactly-once Parquet output: deterministic files, then a commit entry.

Layout under the sink's URL::

    batch=<id:020d>/part-<instance:05d>.parquet   written by instance <instance> of batch <id>
    _commits/<id:020d>.json                         {"batch", "files", "rows"}: the batch is visible

An instance writes its file *before* the pipeline's checkpoint commits (staging); the
``_commits`` entry is created after (publishing). A reader that follows ``_commits``
(:func:`read_parquet_sink`) therefore never sees a partial or uncommitted batch. A rerun
of a batch replays the same plan at the same parallelism, so it rewrites byte-identical
files at the same paths; creating the commit entry is idempotent.
"""

from __future__ import annotations

import io
import json
from collections.abc import Sequence
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from microbatch.errors import SinkError
from microbatch.settings import Settings
from microbatch.storage import AlreadyExistsError, ObjectNotFoundError, ObjectStore, open_store

COMMITS = "_commits/"


def data_key(batch_id: int, instance: int) -> str:
    return f"batch={batch_id:020d}/part-{instance:05d}.parquet"


def commit_key(batch_id: int) -> str:
    return f"{COMMITS}{batch_id:020d}.json"


def to_table(sink_name: str, records: Sequence[Any], schema: pa.Schema | None) -> pa.Table:
    try:
        return pa.Table.from_pylist(list(records), schema=schema)
    except (pa.ArrowException, TypeError, ValueError) as e:
        raise SinkError(
            f"sink {sink_name!r}: records do not fit its schema ({e}); first record: "
            f"{records[0]!r:.300}"
        ) from e


def encode_parquet(table: pa.Table) -> bytes:
    """Parquet bytes that depend only on the table (no timestamps in the metadata)."""
    buf = io.BytesIO()
    pq.write_table(table, buf, compression="zstd")
    return buf.getvalue()


def stage_parquet(
    store: ObjectStore, sink_name: str, batch_id: int, instance: int, table: pa.Table
) -> dict[str, Any] | None:
    """Write one instance's output of a batch; None when it has no rows (no file)."""
    if table.num_rows == 0:
        return None
    key = data_key(batch_id, instance)
    try:
        store.put(key, encode_parquet(table))
    except Exception as e:
        raise SinkError(f"sink {sink_name!r}: writing {store.url}/{key} failed: {e}") from e
    return {"file": key, "rows": table.num_rows}


def is_published(store: ObjectStore, batch_id: int) -> bool:
    return store.exists(commit_key(batch_id))


def publish_parquet(store: ObjectStore, batch_id: int, staged: Sequence[dict[str, Any]]) -> bool:
    """Make batch ``batch_id`` visible; False if it already was (a rerun after a crash)."""
    files = sorted(s["file"] for s in staged)
    body = {"batch": batch_id, "files": files, "rows": sum(s["rows"] for s in staged)}
    try:
        store.create(commit_key(batch_id), json.dumps(body, sort_keys=True).encode())
    except AlreadyExistsError:
        return False
    return True


def committed_batches(store: ObjectStore) -> list[int]:
    ids = []
    for key in store.list(COMMITS):
        name = key[len(COMMITS) :]
        if name.endswith(".json") and name[:-5].isdigit():
            ids.append(int(name[:-5]))
    return sorted(ids)


def unpublish_after(store: ObjectStore, batch_id: int) -> list[int]:
    """Hide every batch after ``batch_id`` (replays from an older checkpoint); their files
    are rewritten when those batches run again."""
    hidden = [b for b in committed_batches(store) if b > batch_id]
    for b in reversed(hidden):
        store.delete(commit_key(b))
    return hidden


def read_parquet_sink(url: str, settings: Settings | None = None) -> pa.Table:
    """Every row of every committed batch, in batch then instance order."""
    store = open_store(url, settings)
    tables = []
    for batch in committed_batches(store):
        body = json.loads(store.get(commit_key(batch)))
        for key in body["files"]:
            try:
                data = store.get(key)
            except ObjectNotFoundError:
                raise SinkError(
                    f"{store.url}: batch {batch} is committed but its file {key} is missing"
                ) from None
            tables.append(pq.read_table(io.BytesIO(data)))
    if not tables:
        return pa.table({})
    return pa.concat_tables(tables, promote_options="default")
