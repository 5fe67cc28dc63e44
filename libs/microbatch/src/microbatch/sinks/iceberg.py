"""Exactly-once Apache Iceberg output: Parquet files staged per instance, one snapshot per
batch whose summary names the app (``<pipeline>/<sink>``) and the batch (docs/iceberg.md).

The sink is the protocol's face (:class:`IcebergSink`); the work is in modules below it,
each one concept, imports pointing down:

- :mod:`~microbatch.sinks.iceberg_target`: the table as a pipeline writes it (stage,
  publish once, rewinds and replacement, GC of losing attempts, maintenance);
- :mod:`~microbatch.sinks.iceberg_optimize`: compaction per batch, one ``replace`` snapshot;
- :mod:`~microbatch.sinks.iceberg_expire`: snapshot expiry and the orphan-file sweep;
- :mod:`~microbatch.sinks.iceberg_table`: the table as an app reads it (its batches);
- :mod:`~microbatch.sinks.iceberg_commit`: one snapshot committed at most once;
- :mod:`~microbatch.sinks.iceberg_schema`: the sink's schema against the table's;
- :mod:`~microbatch.sinks.iceberg_files`: data files' names, bytes and entries;
- :mod:`~microbatch.sinks.iceberg_history`: what snapshot summaries record;
- :mod:`~microbatch.sinks.iceberg_catalog`: where the tables are.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
from collections.abc import Mapping, Sequence
from typing import Any

import pyarrow as pa

from microbatch.datasets import DatasetRef, url_dataset
from microbatch.errors import ConfigError
from microbatch.settings import Settings
from microbatch.sinks.base import (
    Awaiting,
    PublishContext,
    Sink,
    StageContext,
    Staged,
    conformed,
    partition_columns,
    rows_to_table,
)
from microbatch.sinks.iceberg_catalog import IcebergCatalog
from microbatch.sinks.iceberg_target import IcebergTarget
from microbatch.validation import check_name

__all__ = ["IcebergCatalog", "IcebergSink", "IcebergTarget", "read_iceberg_sink"]


@dataclasses.dataclass(frozen=True)
class IcebergSink(Sink):
    """An Iceberg table ``table`` (``namespace.name``) in ``catalog``, one snapshot per
    batch, exactly once.

    ``schema`` (a ``pyarrow.Schema``) is the table's, created from it if missing;
    ``partition_by`` names string, integer, boolean or date columns (identity partitions).
    ``catalog`` is an :class:`IcebergCatalog` (or its properties as a dict); None means
    :meth:`IcebergCatalog.embedded`. Read with any Iceberg reader.
    """

    name: str
    table: str
    schema: Any
    catalog: Any = None
    partition_by: tuple[str, ...] = ()

    retractable = True

    def __post_init__(self) -> None:
        check_name("sink", self.name)
        if not isinstance(self.table, str) or len(self.table.split(".")) < 2:
            raise ConfigError(
                f"sink {self.name!r}: table {self.table!r} must be 'namespace.name' (an Iceberg "
                "table identifier)"
            )
        if importlib.util.find_spec("pyiceberg") is None:
            raise ConfigError(
                f"sink {self.name!r}: the Iceberg sink needs the pyiceberg package "
                "(pip install 'pyiceberg[sql-sqlite,pyarrow]==0.12.0'; `make venv` installs it)"
            )
        if not isinstance(self.schema, pa.Schema):
            raise ConfigError(
                f"sink {self.name!r}: schema must be a pyarrow.Schema (the Iceberg table's "
                f"columns), got {type(self.schema).__name__}"
            )
        if isinstance(self.catalog, Mapping):
            object.__setattr__(self, "catalog", IcebergCatalog(properties=self.catalog))  # type: ignore[arg-type]
        elif self.catalog is not None and not isinstance(self.catalog, IcebergCatalog):
            raise ConfigError(
                f"sink {self.name!r}: catalog must be an IcebergCatalog or a dict of pyiceberg "
                f"catalog properties, got {type(self.catalog).__name__}"
            )
        columns = partition_columns(self.name, self.schema, self.partition_by)
        object.__setattr__(self, "partition_by", columns)

    def catalog_for(self, settings: Settings) -> IcebergCatalog:
        return self.catalog if self.catalog is not None else IcebergCatalog.embedded(settings)

    def target(self, settings: Settings | None, pipeline: str | None) -> IcebergTarget:
        return IcebergTarget(self, pipeline, settings)

    def stage(self, ctx: StageContext, rows: Sequence[Any]) -> Staged | None:
        return self.stage_table(ctx, rows_to_table(self.name, rows, self.schema))

    def stage_columns(self, ctx: StageContext, table: pa.Table) -> Staged | None:
        return self.stage_table(ctx, conformed(self.name, table, self.schema))

    def stage_table(self, ctx: StageContext, table: pa.Table) -> Staged | None:
        if table.num_rows == 0:
            return None
        files = self.target(ctx.settings, ctx.pipeline).write_files(
            table, ctx.batch_id, ctx.instance, ctx.attempt
        )
        key = (
            f"{ctx.layout.staging_dir(ctx.batch_id)}{self.name}/"
            f"part-{ctx.instance:05d}-{ctx.attempt}.json"
        )
        ctx.checkpoint_store.put(key, json.dumps({"files": files}, sort_keys=True).encode())
        return Staged(key, table.num_rows)

    def publish(self, ctx: PublishContext) -> None:
        files = [
            f for s in ctx.staged for f in json.loads(ctx.checkpoint_store.get(s.file))["files"]
        ]
        self.target(ctx.settings, ctx.pipeline).publish(
            ctx.batch_id, files, ctx.end_offsets, ctx.supersedes
        )

    def publish_rewind(self, ctx: PublishContext, undone: Sequence[int]) -> None:
        self.target(ctx.settings, ctx.pipeline).publish_rewind(ctx.batch_id, undone)

    def awaiting_replacement(self, settings: Settings, undone: Sequence[int]) -> Awaiting:
        # As for Delta: the hook does not get the pipeline, so any app of this sink matches.
        return self.target(settings, None).awaiting_replacement(undone)

    def collect_orphans(self, settings: Settings, batches: Sequence[int]) -> int:
        return self.target(settings, None).collect_orphans(batches)

    def shared_storage_url(self) -> str | None:
        return None if self.catalog is None else self.catalog.get("warehouse")

    def dataset(self, settings: Settings) -> DatasetRef:
        """The table's location (OpenLineage names a table by where its files are)."""
        table = self.target(settings, None).load()
        if table is not None:
            return url_dataset(table.location())
        warehouse = self.catalog_for(settings).get("warehouse")
        if warehouse:  # where a SQL catalog will put it
            return url_dataset(f"{warehouse.rstrip('/')}/{self.table.replace('.', '/')}")
        return DatasetRef("iceberg", self.table)

    def last_published(self, settings: Settings, pipeline: str) -> int | None:
        target = self.target(settings, pipeline)
        table = target.load()
        return None if table is None else target.committed_batch(table)


def read_iceberg_sink(sink: IcebergSink, settings: Settings | None = None) -> pa.Table:
    """The table's current rows (pyiceberg's scan), for tests and tools."""
    table = sink.target(settings, None).load()
    if table is None:
        return pa.table({f.name: pa.array([], f.type) for f in sink.schema})
    return table.scan().to_arrow()
