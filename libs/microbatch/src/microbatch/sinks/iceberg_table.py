"""The Iceberg sink's table as one app (``<pipeline>/<sink>``) sees it: loaded from the
catalog, the app's newest batch (from the history), its visible batches (from the current
snapshot's file names) and the files live snapshots reference.

Without a pipeline, "the app" is any app of the sink: the rewind and GC hooks of the sink
protocol get no pipeline.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from microbatch.settings import Settings
from microbatch.sinks.delta_files import app_tag
from microbatch.sinks.iceberg_catalog import IcebergCatalog
from microbatch.sinks.iceberg_files import FILE
from microbatch.sinks.iceberg_history import APP, committed_batch

log = logging.getLogger(__name__)

__all__ = ["AppTable"]


class AppTable:
    """Table ``identifier`` in ``catalog``, as app ``<pipeline>/<sink_name>`` (any app of
    the sink, with ``pipeline=None``) reads it."""

    def __init__(
        self,
        catalog: IcebergCatalog,
        identifier: str,
        sink_name: str,
        pipeline: str | None,
        settings: Settings,
    ) -> None:
        self.catalog = catalog
        self.identifier = identifier
        self.sink_name = sink_name
        self.pipeline = pipeline
        self.settings = settings
        self.app_id = f"{pipeline}/{sink_name}"
        owner = f"pipeline {pipeline!r} " if pipeline is not None else ""
        self.where = f"{owner}sink {sink_name!r} (Iceberg table {identifier})"

    def open_catalog(self) -> Any:
        return self.catalog.open(self.settings)

    def load(self) -> Any:
        """The table as the catalog has it now, or None if there is none yet."""
        from pyiceberg.exceptions import NoSuchTableError

        try:
            return self.open_catalog().load_table(self.identifier)
        except NoSuchTableError:
            return None

    def committed_batch(self, table: Any) -> int | None:
        """The newest batch this app committed in the current lineage."""
        return committed_batch(table, self.app_id)

    def mine(self, summary: Mapping[str, Any]) -> bool:
        """Did this app (any app of the sink, without a pipeline) commit the snapshot?"""
        app = str(summary.get(APP, ""))
        if self.pipeline is None:
            return app.endswith(f"/{self.sink_name}")
        return app == self.app_id

    def app_tag(self) -> str | None:
        """The app's tag in file names; None (any) without a pipeline."""
        return None if self.pipeline is None else app_tag(self.app_id)

    def visible_batches(self, table: Any) -> dict[int, list[Any]]:
        """This app's (any app's, without a pipeline) batches with files in the current
        snapshot: batch → its ``DataFile``s, found by their names."""
        snapshot = table.current_snapshot()
        if snapshot is None:
            return {}
        app = self.app_tag()
        out: dict[int, list[Any]] = {}
        for manifest in snapshot.manifests(table.io):
            for entry in manifest.fetch_manifest_entry(table.io, discard_deleted=True):
                m = FILE.search(entry.data_file.file_path)
                if m and (app is None or m["app"] == app):
                    out.setdefault(int(m["batch"]), []).append(entry.data_file)
        return out

    def referenced_files(self, table: Any) -> set[str]:
        """Every data file path a live snapshot of the table names (any writer's), also
        as a file the snapshot removed."""
        manifests = {m.manifest_path: m for s in table.snapshots() for m in s.manifests(table.io)}
        return {
            entry.data_file.file_path
            for m in manifests.values()
            for entry in m.fetch_manifest_entry(table.io, discard_deleted=False)
        }
