"""The Iceberg sink's data files: their names, their Parquet bytes carrying the table's
field ids, and the entries that name them in a snapshot.

A data file's name says whose batch it holds, so the current snapshot shows which batches
are visible without reading any history (a backfill finds the files to replace by it):

``mb-<app>-b<batch>-i<instance>-<n>-<attempt>.parquet``: staged by a stage-2 attempt;
``mb-<app>-b<batch>-i<instance>-<n>-merged-<snapshot>_<token>.parquet``: an optimize's merge
of one batch's files (no attempt id can spell ``merged-``: '-' is not in an id), so the GC
of losing attempts never takes one for theirs.

An entry (what staging hands publishing through the checkpoint store, as JSON) holds the
path, the size, the partition, the field ids and the column statistics;
:func:`data_file` turns it into pyiceberg's ``DataFile``.
"""

from __future__ import annotations

import base64
import io
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import pyarrow as pa

from microbatch.errors import SinkError
from microbatch.settings import Settings
from microbatch.sinks.parquet import encode_parquet
from microbatch.storage import open_store

__all__ = [
    "FILE",
    "batch_prefix",
    "data_file",
    "data_root",
    "describe",
    "metadata_root",
    "split",
    "staging_attempt",
    "write_data_files",
]

FILE = re.compile(
    r"(?:^|/)mb-(?P<app>[0-9a-f]{8})-b(?P<batch>\d{20})-i(?P<instance>\d{5})-(?P<n>\d{4})-"
    r"(?:merged-(?P<merged>\w+)|(?P<attempt>\w+))\.parquet$"
)


def staging_attempt(path: str) -> str | None:
    """The attempt that staged the data file at ``path``; None for an optimize's merged file
    and for anything else."""
    m = FILE.search(path)
    return None if m is None else m["attempt"]


def batch_prefix(key: str) -> str:
    """``<folder>/mb-<app>-b<batch>-`` of a data file: where its batch's attempts write."""
    folder, _, name = key.rpartition("/")
    return (folder + "/" if folder else "") + name[: name.index("-i")] + "-"


def data_root(table: Any) -> str:
    """Where the table's data files go, with a trailing '/'."""
    root = table.properties.get("write.data.path") or f"{table.location().rstrip('/')}/data"
    return root.rstrip("/") + "/"


def metadata_root(table: Any) -> str:
    """Where the table's manifests and manifest lists go, with a trailing '/'."""
    root = table.properties.get("write.metadata.path") or f"{table.location().rstrip('/')}/metadata"
    return root.rstrip("/") + "/"


def split(rows: pa.Table, columns: Sequence[str]) -> list[tuple[tuple[Any, ...], pa.Table]]:
    """(partition values, its rows), one per distinct value, in a fixed order (so reruns
    name and fill the same files). Iceberg keeps partition columns in the files too."""
    if not columns:
        return [((), rows)]
    groups: dict[tuple[Any, ...], list[int]] = {}
    for i, row in enumerate(rows.select(list(columns)).to_pylist()):
        groups.setdefault(tuple(row[c] for c in columns), []).append(i)
    order = sorted(groups, key=lambda vs: [(v is None, str(v)) for v in vs])
    return [(vs, rows.take(pa.array(groups[vs], pa.int64()))) for vs in order]


def write_data_files(
    table: Any,
    rows: pa.Table,
    partition_by: Sequence[str],
    name: Callable[[int], str],
    settings: Settings,
    where: str,
) -> list[dict[str, Any]]:
    """One Parquet file per partition value of ``rows`` (the ``n``-th named ``name(n)``),
    with the table's field ids, in its data folder; their entries."""
    from pyiceberg.io.pyarrow import schema_to_pyarrow
    from pyiceberg.partitioning import partition_record_value
    from pyiceberg.typedef import Record

    schema, spec = table.schema(), table.spec()
    file_schema = schema_to_pyarrow(schema.select(*rows.column_names))
    rows = pa.Table.from_arrays(
        [rows.column(f.name).cast(f.type) for f in file_schema], schema=file_schema
    )
    root = data_root(table)
    store, written = open_store(root, settings), []
    for n, (values, part) in enumerate(split(rows, partition_by)):
        record = [
            partition_record_value(f, v, schema) for f, v in zip(spec.fields, values, strict=True)
        ]
        folder = spec.partition_to_path(Record(*record), schema) + "/" if record else ""
        key = folder + name(n)
        body = encode_parquet(part)
        try:
            store.put(key, body)
        except Exception as e:
            raise SinkError(f"{where}: writing {root}{key} failed: {e}") from e
        written.append(describe(body, root + key, spec.spec_id, record, schema, table.properties))
    return written


def describe(
    body: bytes,
    path: str,
    spec_id: int,
    partition: Sequence[Any],
    schema: Any,
    properties: Mapping[str, str],
) -> dict[str, Any]:
    """The entry of the Parquet file ``body`` at ``path``, its statistics keyed by the
    field ids of ``schema`` (an Iceberg schema holding the file's columns)."""
    import pyarrow.parquet as pq
    from pyiceberg.io.pyarrow import (
        compute_statistics_plan,
        data_file_statistics_from_parquet_metadata,
        parquet_path_to_id_mapping,
    )

    metadata = pq.read_metadata(io.BytesIO(body))
    stats = data_file_statistics_from_parquet_metadata(
        metadata, compute_statistics_plan(schema, properties), parquet_path_to_id_mapping(schema)
    ).to_serialized_dict()
    arrow = metadata.schema.to_arrow_schema()
    return {
        "path": path,
        "size": len(body),
        "spec_id": spec_id,
        "partition": list(partition),
        "field_ids": {f.name: f.metadata[b"PARQUET:field_id"].decode() for f in arrow},
        "stats": _stats_to_json(stats),
    }


def data_file(table: Any, entry: Mapping[str, Any], where: str, check_ids: bool = True) -> Any:
    """pyiceberg's ``DataFile`` for ``entry``; a :class:`SinkError` if the table now calls
    one of its field ids otherwise (a column dropped or renamed since it was written).
    ``check_ids=False``: no check (a merge of files the table already holds)."""
    from pyiceberg.manifest import DataFile, DataFileContent, FileFormat
    from pyiceberg.typedef import Record

    schema = table.schema()
    for name, field_id in entry["field_ids"].items() if check_ids else ():
        current = schema.find_column_name(int(field_id))
        if current != name:
            raise SinkError(
                f"{where}: staged file {entry['path']} holds column {name!r} as field "
                f"id {field_id}, which the table now calls {current!r} (the column was "
                "dropped or renamed since the batch was staged); restore the column, or "
                "rewind the pipeline to before this batch and run it again"
            )
    return DataFile.from_args(
        content=DataFileContent.DATA,
        file_path=entry["path"],
        file_format=FileFormat.PARQUET,
        partition=Record(*entry["partition"]),
        file_size_in_bytes=int(entry["size"]),
        sort_order_id=None,
        spec_id=int(entry["spec_id"]),
        equality_ids=None,
        key_metadata=None,
        **_stats_from_json(entry["stats"]),
    )


def _stats_to_json(stats: Mapping[str, Any]) -> dict[str, Any]:
    """pyiceberg's data-file statistics as JSON: int keys as strings, bounds in base64."""
    as_json = lambda v: base64.b64encode(v).decode() if isinstance(v, bytes) else v  # noqa: E731
    return {key: {str(k): as_json(v) for k, v in value.items()} if isinstance(value, dict)
            else value for key, value in stats.items()}  # fmt: skip


def _stats_from_json(stats: Mapping[str, Any]) -> dict[str, Any]:
    bounds = ("lower_bounds", "upper_bounds")
    return {key: {int(k): base64.b64decode(v) if key in bounds else v for k, v in value.items()}
            if isinstance(value, dict) else value for key, value in stats.items()}  # fmt: skip
