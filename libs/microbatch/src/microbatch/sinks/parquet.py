"""Exactly-once Parquet output: deterministic files, then a commit entry.

Layout under the sink's URL::

    batch=<id:020d>/part-<instance:05d>-<attempt>.parquet   instance <instance>'s output
    _commits/<id:020d>.json                                  the batch is visible (below)
    _pipeline.json                                           the pipeline it belongs to

An instance writes its file *before* the pipeline's checkpoint commits (staging); the
``_commits`` entry, created after (publishing), lists the files of the attempt that
committed. A reader that follows ``_commits`` (:func:`read_parquet_sink`) therefore never
sees a partial or uncommitted batch. A rerun of a batch replays the same plan at the same
parallelism, so it writes byte-identical files, under its own attempt's names: an attempt
that lost the commit (a retry's twin, a stalled zombie) never overwrites a published file,
its files are simply never listed. Creating the commit entry is idempotent.

Replays and backfills. A rewind to an older checkpoint (``microbatch replay``, an Airflow
backfill) publishes an entry that lists the batches it *undoes* (``"undoes"``); their
output stays visible, because nothing has replaced it yet. Each later batch records its
end offsets, and its entry *supersedes* every undone batch whose input it has now read
again (``end offsets of the undone batch <= its own``, on every partition). Hiding the old
output and showing the new one is one object creation: when old and new batches cover the
same intervals, a reader sees each interval once, old or new. An old batch spanning several
new ones stays until the last of them, its rows next to the first recomputed ones (rather
than leaving a gap).

Which batches an entry supersedes is decided before the checkpoint commits and recorded in
it, so a rerun publishes the same entry. The undone batches still awaiting replacement
travel from checkpoint to checkpoint (:func:`after_batch`); only a rewind reads the
``_commits`` entries (:func:`awaiting_replacement`), so publishing costs the same after
ten batches or ten thousand.

One pipeline owns an output. Batch ids are the pipeline's checkpoint ids, so a second
pipeline publishing to the same location would find the first one's entries under its own
batch ids and take them as its own (reporting rows no reader ever sees), or interleave its
batches with the other's. The first publish claims the location (``_pipeline.json``, an
exclusive create); every publish checks the claim, and so does the check before a
pipeline's first batch (:meth:`ParquetSink.last_published`): another pipeline's output is
refused with a :class:`~microbatch.errors.ConfigError`.

Entry body: ``{"batch", "pipeline", "files", "rows", "end_offsets", "supersedes",
"undoes"}`` (entries written before outputs had owners have no ``"pipeline"``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from microbatch.datasets import DatasetRef, url_dataset
from microbatch.errors import ConfigError, SinkError
from microbatch.settings import Settings
from microbatch.sinks.base import (
    Awaiting,
    PublishContext,
    Sink,
    StageContext,
    Staged,
    conformed,
    rows_to_table,
)
from microbatch.sinks.replacement import after_batch
from microbatch.storage import AlreadyExistsError, ObjectNotFoundError, ObjectStore, open_store
from microbatch.validation import check_name

COMMITS = "_commits/"
OWNER = "_pipeline.json"
__all__ = [
    "COMMITS",
    "OWNER",
    "Awaiting",
    "ParquetSink",
    "after_batch",
    "awaiting_replacement",
    "check_owner",
    "claim_output",
    "collect_orphans",
    "commit_entries",
    "committed_batches",
    "publish_parquet",
    "publish_rewind",
    "read_parquet_sink",
    "stage_parquet",
    "visible_batches",
]


@dataclasses.dataclass(frozen=True)
class ParquetSink(Sink):
    """Parquet files at ``url`` (a path, ``file:///dir`` or ``s3://bucket/prefix``).

    Each batch writes ``batch=<id>/part-<instance>.parquet``; a batch becomes visible when
    its entry appears in ``_commits/`` — use :func:`read_parquet_sink` (or follow
    ``_commits/`` yourself) to read only committed batches. ``schema`` (a
    ``pyarrow.Schema``) is recommended; without it each file's schema is inferred from
    all its rows (every field any row has; see :func:`~microbatch.sinks.base.rows_to_table`).
    """

    name: str
    url: str
    schema: Any = None

    retractable = True

    def __post_init__(self) -> None:
        check_name("sink", self.name)
        if not self.url:
            raise ConfigError(f"sink {self.name!r}: url is empty")

    def encode(self, rows: Sequence[Any], where: str = "") -> pa.Table:
        return rows_to_table(self.name, rows, self.schema, where)

    def stage(self, ctx: StageContext, rows: Sequence[Any]) -> Staged | None:
        where = f"pipeline {ctx.pipeline!r} batch {ctx.batch_id} instance {ctx.instance}"
        return self.stage_table(ctx, self.encode(rows, where))

    def stage_columns(self, ctx: StageContext, table: pa.Table) -> Staged | None:
        return self.stage_table(ctx, conformed(self.name, table, self.schema))

    def stage_table(self, ctx: StageContext, table: pa.Table) -> Staged | None:
        store = open_store(self.url, ctx.settings)
        staged = stage_parquet(store, self.name, ctx.batch_id, ctx.instance, table, ctx.attempt)
        if staged is not None:
            drop_if_batch_collected(store, ctx, self.name, staged)
        return staged

    def publish(self, ctx: PublishContext) -> None:
        store = open_store(self.url, ctx.settings)
        publish_parquet(
            store, ctx.batch_id, ctx.staged, ctx.end_offsets, ctx.supersedes, ctx.pipeline
        )

    def publish_rewind(self, ctx: PublishContext, undone: Sequence[int]) -> None:
        publish_rewind(open_store(self.url, ctx.settings), ctx.batch_id, undone, ctx.pipeline)

    def awaiting_replacement(self, settings: Settings, undone: Sequence[int]) -> Awaiting:
        return awaiting_replacement(open_store(self.url, settings), undone)

    def collect_orphans(self, settings: Settings, batches: Sequence[int]) -> int:
        return collect_orphans(open_store(self.url, settings), batches)

    def shared_storage_url(self) -> str | None:
        return self.url

    def dataset(self, settings: Settings) -> DatasetRef:
        return url_dataset(self.url)

    def last_published(self, settings: Settings, pipeline: str) -> int | None:
        """The newest published batch; a :class:`ConfigError` if another pipeline owns
        this output (checked before a pipeline's first batch: before any work)."""
        store = open_store(self.url, settings)
        check_owner(store, pipeline)
        batches = committed_batches(store)
        if batches:
            _check_entry_owner(store, batches[-1], pipeline)
        return batches[-1] if batches else None


def batch_prefix(batch_id: int) -> str:
    return f"batch={batch_id:020d}/"


def data_key(batch_id: int, instance: int, attempt: str = "") -> str:
    suffix = f"-{attempt}" if attempt else ""
    return f"{batch_prefix(batch_id)}part-{instance:05d}{suffix}.parquet"


def commit_key(batch_id: int) -> str:
    return f"{COMMITS}{batch_id:020d}.json"


def encode_parquet(table: pa.Table) -> bytes:
    """Parquet bytes that depend only on the table (no timestamps in the metadata)."""
    buf = io.BytesIO()
    pq.write_table(table, buf, compression="zstd")
    return buf.getvalue()


def stage_parquet(
    store: ObjectStore,
    sink_name: str,
    batch_id: int,
    instance: int,
    table: pa.Table,
    attempt: str = "",
) -> Staged | None:
    """Write one instance's output of a batch; None when it has no rows (no file)."""
    if table.num_rows == 0:
        return None
    key = data_key(batch_id, instance, attempt)
    try:
        store.put(key, encode_parquet(table))
    except Exception as e:
        raise SinkError(f"sink {sink_name!r}: writing {store.url}/{key} failed: {e}") from e
    return Staged(key, table.num_rows)


def drop_if_batch_collected(
    store: ObjectStore, ctx: StageContext, sink_name: str, staged: Staged
) -> None:
    """After writing a part: if retention already removed the batch's plan, the batch's
    orphans may have been collected before the part existed, and nothing would ever
    delete it (a killed or fenced attempt that wakes late). Delete it and fail: the put
    comes before this look, and retention deletes the plan before it lists the batch's
    files, so one of the two always sees the other."""
    if ctx.checkpoint_store.exists(ctx.layout.plan_key(ctx.batch_id)):
        return
    store.delete(staged.file)
    raise SinkError(
        f"pipeline {ctx.pipeline!r} batch {ctx.batch_id} sink {sink_name!r}: the batch left "
        "retention while this attempt staged its part (its plan is gone): a stalled "
        "attempt; the part was deleted, and the batch's output is the committed one's"
    )


def is_published(store: ObjectStore, batch_id: int) -> bool:
    return store.exists(commit_key(batch_id))


def owner_of(store: ObjectStore) -> str | None:
    """The pipeline that claimed this output; None if none did (nothing published yet, or
    only by a version that did not claim outputs)."""
    try:
        return str(json.loads(store.get(OWNER))["pipeline"])
    except ObjectNotFoundError:
        return None


def check_owner(store: ObjectStore, pipeline: str) -> None:
    """Refuse an output that another pipeline claimed."""
    owner = owner_of(store)
    if owner is not None and owner != pipeline:
        raise _owned_by_another(store, owner, pipeline, f"{store.url}/{OWNER}")


def claim_output(store: ObjectStore, pipeline: str) -> None:
    """Make ``pipeline`` this output's owner unless one is recorded; refuse it if another
    pipeline is, or (for an output published before owners were recorded) if another
    pipeline wrote its newest entry. Of two pipelines claiming at once exactly one wins
    (exclusive create)."""
    if owner_of(store) is None:
        batches = committed_batches(store)  # once per output: later publishes find the owner
        if batches:
            _check_entry_owner(store, batches[-1], pipeline)
        body = json.dumps({"pipeline": pipeline}, sort_keys=True).encode()
        with contextlib.suppress(AlreadyExistsError):
            store.create(OWNER, body)
    check_owner(store, pipeline)


def _check_entry_owner(store: ObjectStore, batch_id: int, pipeline: str) -> None:
    """Refuse a commit entry another pipeline wrote (also where no owner was claimed)."""
    try:
        entry = json.loads(store.get(commit_key(batch_id)))
    except ObjectNotFoundError:
        return
    writer = entry.get("pipeline")
    if writer is not None and writer != pipeline:
        raise _owned_by_another(store, writer, pipeline, f"{store.url}/{commit_key(batch_id)}")


def _owned_by_another(store: ObjectStore, owner: str, pipeline: str, seen_in: str) -> ConfigError:
    return ConfigError(
        f"pipeline {pipeline!r}: the Parquet output {store.url} belongs to pipeline "
        f"{owner!r} ({seen_in}), so {pipeline!r} must not publish there: batch ids are each "
        "pipeline's own, and its batches would be mixed with, or mistaken for, the other's. "
        f"Give the sink of {pipeline!r} a location of its own."
    )


def publish_parquet(
    store: ObjectStore,
    batch_id: int,
    staged: Sequence[Staged],
    end_offsets: Mapping[str, int] | None = None,
    supersedes: Sequence[int] = (),
    pipeline: str | None = None,
) -> bool:
    """Make batch ``batch_id`` of ``pipeline`` visible, replacing the undone batches
    ``supersedes`` (from :func:`after_batch`); False if it already was visible (a rerun
    after a crash). A :class:`ConfigError` if another pipeline owns the output or wrote
    that batch's entry: it is never taken for this pipeline's.

    ``end_offsets`` maps ``"topic:partition"`` to the offset after the batch's input."""
    if is_published(store, batch_id):
        if pipeline is not None:
            _check_entry_owner(store, batch_id, pipeline)
            check_owner(store, pipeline)
        return False
    if pipeline is not None:
        claim_output(store, pipeline)
    files = sorted(s.file for s in staged)
    body = {
        "batch": batch_id,
        **({} if pipeline is None else {"pipeline": pipeline}),
        "files": files,
        "rows": sum(s.rows for s in staged),
        "end_offsets": dict(end_offsets or {}),
        "supersedes": sorted(supersedes),
    }
    return _create_entry(store, batch_id, body)


def awaiting_replacement(store: ObjectStore, undone: Iterable[int] = ()) -> Awaiting:
    """From the ``_commits`` entries: the undone batches (also ``undone``, a rewind about
    to be published) whose output is visible, with their end offsets. Reads every entry:
    for a rewind, or a checkpoint written before the mapping was recorded."""
    entries = commit_entries(store)
    all_undone = {b for e in entries.values() for b in e.get("undoes", ())} | set(undone)
    visible = set(visible_batches(entries))
    return {str(b): entries[b].get("end_offsets") for b in sorted(all_undone & visible)}


def publish_rewind(
    store: ObjectStore, batch_id: int, undone: Sequence[int], pipeline: str | None = None
) -> bool:
    """Record that checkpoint ``batch_id`` rewinds ``pipeline`` and undoes ``undone``:
    their output stays visible until later batches supersede it."""
    body: dict[str, Any] = {"batch": batch_id, "files": [], "rows": 0, "undoes": sorted(undone)}
    if pipeline is not None:
        claim_output(store, pipeline)
        body["pipeline"] = pipeline
    return _create_entry(store, batch_id, body)


def _create_entry(store: ObjectStore, batch_id: int, body: dict[str, Any]) -> bool:
    try:
        store.create(commit_key(batch_id), json.dumps(body, sort_keys=True).encode())
    except AlreadyExistsError:
        return False
    return True


def collect_orphans(store: ObjectStore, batches: Sequence[int]) -> int:
    """Delete the files of published ``batches`` that their commit entry does not list:
    parts of attempts that lost the commit. A batch without an entry (a rewind, a
    reshard, a batch with no rows here) lists none."""
    deleted = 0
    for batch in batches:
        try:
            listed = set(json.loads(store.get(commit_key(batch)))["files"])
        except ObjectNotFoundError:
            listed = set()
        for key in store.list(batch_prefix(batch)):
            if key not in listed:
                store.delete(key)
                deleted += 1
    return deleted


def commit_entries(store: ObjectStore) -> dict[int, dict[str, Any]]:
    """Every commit entry, by batch id."""
    return {b: json.loads(store.get(commit_key(b))) for b in committed_batches(store)}


def visible_batches(entries: Mapping[int, Mapping[str, Any]]) -> list[int]:
    """Batches whose output a reader sees: with files and not superseded."""
    superseded = {b for e in entries.values() for b in e.get("supersedes", ())}
    return [b for b in sorted(entries) if b not in superseded and entries[b]["files"]]


def committed_batches(store: ObjectStore) -> list[int]:
    ids = []
    for key in store.list(COMMITS):
        name = key[len(COMMITS) :]
        if name.endswith(".json") and name[:-5].isdigit():
            ids.append(int(name[:-5]))
    return sorted(ids)


def read_parquet_sink(url: str, settings: Settings | None = None) -> pa.Table:
    """Every row of every visible batch (committed, not superseded), in batch then
    instance order.

    Files written without a declared schema may differ in columns (null where a file
    lacks one) and in numeric width (an int column next to a float one reads as float,
    exactly or not at all); any other difference is a :class:`SinkError`."""
    store = open_store(url, settings)
    tables = []
    entries = commit_entries(store)
    for batch in visible_batches(entries):
        for key in entries[batch]["files"]:
            try:
                data = store.get(key)
            except ObjectNotFoundError:
                raise SinkError(
                    f"{store.url}: batch {batch} is committed but its file {key} is missing"
                ) from None
            tables.append(pq.read_table(io.BytesIO(data)))
    if not tables:
        return pa.table({})
    try:
        return pa.concat_tables(tables, promote_options="permissive")
    except pa.ArrowException as e:
        raise SinkError(
            f"{store.url}: the committed files do not share one schema ({e}); their sink "
            "inferred a different type per file: declare the sink's schema (a "
            "pyarrow.Schema) for new batches, and read these files one by one"
        ) from e
