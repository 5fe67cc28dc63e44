"""One Delta table as one pipeline's sink sees it: reading its snapshot, checking its
schema and its one writer, writing a batch's files, and committing a batch exactly once
(the app transaction) — see :mod:`microbatch.sinks.delta` for the protocol."""

from __future__ import annotations

import contextlib
import json
import logging
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import quote, unquote

import pyarrow as pa

from microbatch.errors import ConfigError, SinkError
from microbatch.settings import Settings
from microbatch.sinks import delta_maintenance
from microbatch.sinks.base import Awaiting
from microbatch.sinks.delta_files import (
    DATA_FILE,
    add_action,
    app_tag,
    file_stats,
    partition_dir,
    partition_value,
    split_partitions,
    storage_options,
    table_location,
)
from microbatch.sinks.delta_schema import SchemaChange, delta_fields, plan_schema
from microbatch.sinks.parquet import encode_parquet
from microbatch.storage import AlreadyExistsError, ObjectNotFoundError, ObjectStore, open_store

if TYPE_CHECKING:
    from microbatch.sinks.delta import DeltaSink

log = logging.getLogger(__name__)

#: Commits re-read and retried after a conflict before publishing gives up.
MAX_ATTEMPTS = 8
FIRST_ENTRY = f"{0:020d}.json"
#: The pipeline that writes the table (created once, exclusively, by its first commit).
#: Under ``_``: Delta readers and VACUUM skip such paths.
OWNER = "_microbatch/owner.json"


class DeltaTarget:
    """The sink's table as one pipeline sees it: where it is and what its app id is."""

    def __init__(self, sink: DeltaSink, pipeline: str | None, settings: Settings | None) -> None:
        self.sink = sink
        self.pipeline = pipeline
        self.settings = settings or Settings.from_env()
        self.uri = table_location(sink.table_uri)
        self.options = storage_options(sink.table_uri, self.settings)
        self.app_id = f"{pipeline}/{sink.name}"
        owner = f"pipeline {pipeline!r} " if pipeline is not None else ""
        self.where = f"{owner}sink {sink.name!r} (Delta table {sink.table_uri})"

    # Reading -----------------------------------------------------------------------------
    def store(self) -> ObjectStore:
        return open_store(self.sink.table_uri, self.settings)

    def load(self) -> Any:
        """The newest snapshot, or None when there is no Delta table yet (a location with
        other files is refused: nothing there may be mistaken for the table)."""
        from deltalake import DeltaTable
        from deltalake.exceptions import TableNotFoundError

        try:
            return DeltaTable(self.uri, storage_options=self.options)
        except TableNotFoundError:
            pass
        foreign = [
            k
            for k in self.store().list("")
            if not (DATA_FILE.search(k) or k.startswith("_microbatch/"))
        ]
        if foreign:
            raise SinkError(
                f"{self.where}: the location holds files but no Delta table (no "
                f"_delta_log/; e.g. {foreign[0]!r}). Point the sink to an empty location, or "
                "convert the Parquet data there to Delta first "
                "(deltalake.convert_to_deltalake)."
            )
        return None

    def check_schema(self, snapshot: Any = None) -> SchemaChange:
        """The schema change the next commit makes (nothing for a new table)."""
        try:  # here, not when the pipeline is built: importing deltalake costs ~0.1 s
            delta_fields(self.sink.schema)
        except Exception as e:
            raise SinkError(
                f"{self.where}: the schema has no Delta equivalent "
                f"({str(e).splitlines()[0] if str(e) else e!r}); use types Delta "
                "has (string, integers, floats, boolean, date, timestamp, decimal, lists, "
                "structs, maps)"
            ) from e
        dt = snapshot if snapshot is not None else self.load()
        if dt is None:
            return SchemaChange()
        meta = dt.metadata()
        fields = json.loads(dt.schema().to_json())["fields"]
        return plan_schema(
            self.where, fields, meta.partition_columns, self.sink.schema, self.sink.partition_by
        )

    def last_published(self) -> int | None:
        """This app's newest committed batch; refuses a table another pipeline writes (the
        runtime asks before a pipeline's first batch: refused before any work)."""
        dt = self.load()
        if dt is None:
            return None
        self.check_owner(dt)
        return dt.transaction_version(self.app_id)

    # Ownership ---------------------------------------------------------------------------
    # One pipeline per table: batch ids are each pipeline's own, and a rewind or the GC of
    # one pipeline cannot tell its batches from another's in the log (their hooks get no
    # pipeline). The first commit records the writer; every later commit checks it.
    def owner(self) -> str | None:
        """The pipeline recorded as the table's writer; None before the first commit."""
        try:
            return str(json.loads(self.store().get(OWNER))["pipeline"])
        except ObjectNotFoundError:
            return None

    def check_owner(self, snapshot: Any = None) -> str | None:
        """Refuse a table another pipeline writes: the recorded owner, or (a table written
        before owners were recorded, with ``snapshot``) a pipeline in its history. Returns
        the recorded owner."""
        owner = self.owner()
        if owner is not None:
            writers, seen_in = {owner}, f"{self.sink.table_uri}/{OWNER}"
        elif snapshot is not None:
            writers, seen_in = pipelines_in_history(snapshot), "its Delta log"
        else:
            return None
        others = sorted(writers - {self.pipeline})
        if others:
            raise ConfigError(
                f"{self.where}: the table is written by pipeline {others[0]!r} (as {seen_in} "
                f"says), so pipeline {self.pipeline!r} must not write it: batch ids are each "
                "pipeline's own, and one pipeline's rewinds and clean-up would remove or "
                f"delete the other's files. Give the sink of pipeline {self.pipeline!r} a "
                "Delta table of its own (a view can union the two)."
            )
        return owner

    def claim(self, snapshot: Any) -> None:
        """Record this pipeline as the table's writer unless one is; refuse the table if
        another pipeline is. Of two pipelines claiming at once exactly one wins (the
        store's exclusive create)."""
        if self.check_owner(snapshot) is not None:
            return
        body = json.dumps({"pipeline": self.pipeline, "sink": self.sink.name}, sort_keys=True)
        with contextlib.suppress(AlreadyExistsError):
            self.store().create(OWNER, body.encode())
        self.check_owner()

    def visible_batches(self, snapshot: Any) -> dict[int, list[dict[str, Any]]]:
        """This app's batches with files in ``snapshot``: batch → its add actions."""
        out: dict[int, list[dict[str, Any]]] = {}
        app = None if self.pipeline is None else app_tag(self.app_id)
        actions = pa.table(snapshot.get_add_actions(flatten=False))
        cols = [c for c in ("path", "size_bytes", "partition") if c in actions.column_names]
        for row in actions.select(cols).to_pylist():
            # The log holds paths URI-encoded; actions and the store take the object key.
            row["path"] = unquote(row["path"])
            m = DATA_FILE.search(row["path"])
            if m and (app is None or m["app"] == app):
                parts = row.pop("partition", None) or {}
                row["partition_values"] = {c: partition_value(v) for c, v in parts.items()}
                out.setdefault(int(m["batch"]), []).append(row)
        return out

    # Staging -----------------------------------------------------------------------------
    def write_files(
        self, table: pa.Table, batch_id: int, instance: int, attempt: str
    ) -> list[dict[str, Any]]:
        """One Parquet file per partition value (partition columns live in the path and
        the log, not the file); what was written, for the add actions."""
        store, written = self.store(), []
        for n, (values, part) in enumerate(split_partitions(table, self.sink.partition_by)):
            folder = "".join(f"{quote(c, safe='')}={partition_dir(v)}/" for c, v in values)
            path = (
                f"{folder}mb-{app_tag(self.app_id)}-b{batch_id:020d}-i{instance:05d}-"
                f"{n:04d}-{attempt or 'x'}.parquet"
            )
            body = encode_parquet(part)
            try:
                store.put(path, body)
            except Exception as e:
                raise SinkError(f"{self.where}: writing {path} failed: {e}") from e
            written.append(
                {
                    "path": path,
                    "size": len(body),
                    "partition_values": {c: v for c, v in values},
                    "stats": json.dumps(file_stats(part), sort_keys=True),
                    "rows": part.num_rows,
                }
            )
        return written

    # Publishing --------------------------------------------------------------------------
    def publish(
        self,
        batch_id: int,
        files: Sequence[Mapping[str, Any]],
        end_offsets: Mapping[str, int] | None = None,
        supersedes: Sequence[int] = (),
        snapshot: Any = None,
    ) -> bool:
        """Commit batch ``batch_id`` once: its files added, the superseded batches' files
        removed, the app transaction set. False if it was already committed or has nothing
        to show. ``snapshot`` (tests): start from this, possibly stale, snapshot."""
        info = {
            "batch": batch_id,
            "end_offsets": dict(end_offsets or {}),
            "supersedes": sorted(supersedes),
        }
        return self._commit(batch_id, files, supersedes, info, snapshot)

    def publish_rewind(self, batch_id: int, undone: Sequence[int]) -> bool:
        """Record that checkpoint ``batch_id`` undoes ``undone`` (a version with no data):
        their files stay visible until the batches that read their input again replace
        them."""
        return self._commit(batch_id, [], (), {"batch": batch_id, "undoes": sorted(undone)})

    def _commit(
        self,
        batch_id: int,
        files: Sequence[Mapping[str, Any]],
        supersedes: Sequence[int],
        info: Mapping[str, Any],
        snapshot: Any = None,
    ) -> bool:
        if not files and not supersedes and "undoes" not in info:
            return False  # an idle batch: no version, no request, no import (like Kafka's)
        from deltalake import CommitProperties, Transaction
        from deltalake.exceptions import CommitFailedError, DeltaError

        props = CommitProperties(
            custom_metadata={"microbatch": {"app": self.app_id, **info}},
            app_transactions=[Transaction(self.app_id, batch_id)],
        )
        adds = [add_action(f) for f in files]
        last_error: Exception | None = None
        claimed = False
        for attempt in range(MAX_ATTEMPTS):
            dt = snapshot if attempt == 0 and snapshot is not None else self.load()
            if dt is None:
                if not adds:  # no table and nothing to add: nothing to record either
                    return False
                self.create_table()
                continue
            if not claimed:  # before anything of this pipeline is committed
                self.claim(dt)
                claimed = True
            done = dt.transaction_version(self.app_id)
            if done is not None and done >= batch_id:
                log.info("%s: batch %s is already committed (txn %s)", self.where, batch_id, done)
                return False
            change = self.check_schema(dt)
            removes = self._removes(dt, supersedes)
            if not adds and not removes and "undoes" not in info:
                return False  # no rows, and the batches it supersedes showed none either
            if change.add:  # its own metaData commit; then re-read and check again
                try:
                    self._add_columns(dt, change)
                except (CommitFailedError, DeltaError) as e:  # a racing change: re-read
                    last_error = e
                continue
            try:
                dt.create_write_transaction(
                    [*adds, *removes],
                    mode="append",
                    schema=dt.schema(),
                    partition_by=list(self.sink.partition_by) or None,
                    commit_properties=props,
                )
                return True
            except CommitFailedError as e:  # a concurrent commit: re-read, check, retry
                log.info("%s: batch %s conflicted (%s); retrying", self.where, batch_id, e)
                last_error = e
                time.sleep(min(0.05 * 2**attempt, 1.0))
        raise SinkError(
            f"{self.where}: could not commit batch {batch_id} after {MAX_ATTEMPTS} attempts "
            f"(other writers keep committing: {last_error}); rerun the batch to publish it"
        )

    def create_table(self) -> bool:
        """Create the empty table (version 0: protocol and metaData) unless it exists;
        False if another writer created it first.

        delta-rs builds the entry (in a scratch folder, so its protocol versions and
        schema encoding are delta-rs's own) and the store's exclusive create writes it: of
        racing creators exactly one wins. (delta-rs's own create, on finding version 0
        taken, commits its CREATE as version 1 instead, with no conflict check: two
        first batches racing would both be committed.)"""
        from deltalake import DeltaTable

        with tempfile.TemporaryDirectory() as scratch:
            DeltaTable.create(
                scratch, self.sink.schema, partition_by=list(self.sink.partition_by) or None
            )
            lines = Path(scratch, "_delta_log", FIRST_ENTRY).read_text().splitlines()
        actions = [json.loads(line) for line in lines]
        for action in actions:
            if "commitInfo" in action:
                action["commitInfo"].get("operationParameters", {})["location"] = self.uri
                action["commitInfo"]["microbatch"] = {"app": self.app_id, "create": True}
        body = "".join(json.dumps(a, separators=(",", ":")) + "\n" for a in actions)
        try:
            self.store().create(f"_delta_log/{FIRST_ENTRY}", body.encode())
        except AlreadyExistsError:
            return False
        log.info("%s: created the Delta table", self.where)
        return True

    def _add_columns(self, dt: Any, change: SchemaChange) -> None:
        from deltalake import CommitProperties, Field, Schema

        fields = Schema.from_arrow(pa.schema(list(change.add))).fields
        log.info("%s: adding columns %s", self.where, [f.name for f in fields])
        dt.alter.add_columns(
            [Field(f.name, f.type, nullable=True) for f in fields],
            commit_properties=CommitProperties(
                custom_metadata={"microbatch": {"app": self.app_id, "schema": "add columns"}}
            ),
        )

    def _removes(self, dt: Any, supersedes: Sequence[int]) -> list[Any]:
        from deltalake.transaction import RemoveAction

        if not supersedes:
            return []
        now = int(time.time() * 1000)
        visible = self.visible_batches(dt)
        return [
            RemoveAction(
                row["path"],
                data_change=True,
                deletion_timestamp=now,
                size=row["size_bytes"],
                partition_values=row["partition_values"],
            )
            for b in sorted(supersedes)
            for row in visible.get(b, ())
        ]

    # Maintenance (delta_maintenance) ------------------------------------------------------
    def collect_orphans(self, batches: Sequence[int]) -> int:
        """See :func:`~microbatch.sinks.delta_maintenance.collect_orphans`."""
        return delta_maintenance.collect_orphans(self, batches)

    def optimize(
        self, dry_run: bool = False, before_commit: Callable[[], None] | None = None
    ) -> dict[str, Any]:
        """See :func:`~microbatch.sinks.delta_maintenance.optimize`."""
        return delta_maintenance.optimize(self, dry_run, before_commit)

    def vacuum(self, retention_hours: float = 168, dry_run: bool = False) -> list[str]:
        """See :func:`~microbatch.sinks.delta_maintenance.vacuum`."""
        return delta_maintenance.vacuum(self, retention_hours, dry_run)

    def awaiting_replacement(self, undone: Iterable[int] = ()) -> Awaiting:
        """Undone batches (recorded by rewinds, plus ``undone``) whose files are visible,
        with the end offsets their commits recorded (read from the history: rewinds only).

        Without a pipeline (a table written before owners were recorded), the one pipeline
        whose commits of this sink the history holds is the one rewinding; two are refused:
        whose batches were undone could not be told apart."""
        dt = self.load()
        if dt is None:
            return {}
        if self.pipeline is None:
            writers = sorted(pipelines_in_history(dt, self.sink.name))
            if len(writers) > 1:
                raise ConfigError(
                    f"{self.where}: pipelines {writers[0]!r} and {writers[1]!r} both write "
                    "the table, so a rewind cannot tell whose batches it undoes. Give "
                    "each pipeline's sink a Delta table of its own."
                )
            if not writers:
                return {}
            return DeltaTarget(self.sink, writers[0], self.settings).awaiting_replacement(undone)
        undoes, ends = set(undone), {}
        for commit in dt.history():
            info = commit.get("microbatch")
            if not isinstance(info, dict) or info.get("app") != self.app_id:
                continue
            undoes.update(info.get("undoes", ()))
            if "end_offsets" in info:
                ends[int(info["batch"])] = info["end_offsets"]
        visible = set(self.visible_batches(dt))
        out: Awaiting = {}
        for b in sorted(undoes & visible):
            if b not in ends:
                raise SinkError(
                    f"{self.where}: batch {b} is visible but its commit is no longer in the "
                    "Delta log (delta.logRetentionDuration expired it), so what it read is "
                    "unknown and it cannot be replaced; raise the table's "
                    "delta.logRetentionDuration above the oldest interval you backfill"
                )
            out[str(b)] = ends[b]
        return out


def pipelines_in_history(snapshot: Any, sink_name: str | None = None) -> set[str]:
    """The pipelines whose commits (of ``sink_name``, or any sink) the table's log holds."""
    out = set()
    for commit in snapshot.history():
        info = commit.get("microbatch")
        app = str(info.get("app", "")) if isinstance(info, dict) else ""
        pipeline, _, sink = app.rpartition("/")
        if pipeline and sink_name in (None, sink):
            out.add(pipeline)
    return out
