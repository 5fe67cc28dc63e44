"""The Delta sink's data files: their names (app, batch, instance, attempt), partition
folders and values as the Delta log writes them, statistics, add actions, and where
delta-rs finds the table (location, S3 options)."""

from __future__ import annotations

import hashlib
import json
import re
import time
from collections.abc import Mapping, Sequence
from typing import Any
from urllib.parse import quote, unquote, urlparse

import pyarrow as pa
import pyarrow.compute as pc

from microbatch.settings import Settings
from microbatch.storage import ObjectStore

NULL_PARTITION = "__HIVE_DEFAULT_PARTITION__"
#: A data file of a batch: staged by an attempt (``-<n>-<attempt>``), or an optimize's
#: merge of a batch's files (``-0000-merged-v<version>_<token>``), which no attempt's id
#: can spell ('-' is not in an id), so the GC of losing attempts never takes one for theirs.
DATA_FILE = re.compile(
    r"(?:^|/)mb-(?P<app>[0-9a-f]{8})-b(?P<batch>\d{20})-i(?P<instance>\d{5})-\d{4}-"
    r"(?:merged-(?P<merged>\w+)|(?P<attempt>\w+))\.parquet$"
)
#: Merged files before they had names of their own: ``-0000-c<version>``.
_OLD_MERGED = re.compile(r"c\d+")


def staging_attempt(path: str) -> str | None:
    """The attempt that staged the data file at ``path``; None for an optimize's merged
    file (of any version of this module) and for anything else."""
    m = DATA_FILE.search(path)
    if m is None or m["attempt"] is None or _OLD_MERGED.fullmatch(m["attempt"]):
        return None
    return m["attempt"]


def app_of(path: str) -> str:
    m = DATA_FILE.search(path)
    assert m is not None  # visible_batches matched it
    return m["app"]


def batch_prefix(path: str) -> tuple[str, str]:
    """(folder, ``mb-<app>-b<batch>-``) of a data file: where its batch's attempts write."""
    folder, _, name = path.rpartition("/")
    return (folder + "/" if folder else ""), name[: name.index("-i")] + "-"


def app_tag(app_id: str) -> str:
    """8 hex digits naming an app in file names (pipeline and sink names may hold '-')."""
    return hashlib.sha256(app_id.encode()).hexdigest()[:8]


def table_location(uri: str) -> str:
    """What delta-rs opens: ``s3://`` as is, ``file://`` and plain paths as absolute paths."""
    import os

    parsed = urlparse(uri)
    if parsed.scheme == "s3":
        return uri.rstrip("/")
    if parsed.scheme == "file":
        return unquote(parsed.path)
    return os.path.abspath(uri)


def storage_options(uri: str, settings: Settings) -> dict[str, str] | None:
    """delta-rs S3 options from the settings (None for local tables). Commit files are
    created with ``If-None-Match: *``, which SeaweedFS, MinIO and AWS S3 honour."""
    if urlparse(uri).scheme != "s3":
        return None
    opts = {"AWS_REGION": settings.s3_region}
    if settings.s3_access_key_id:  # else the AWS default chain, as for boto3
        opts["AWS_ACCESS_KEY_ID"] = settings.s3_access_key_id
        opts["AWS_SECRET_ACCESS_KEY"] = settings.s3_secret_access_key
    if settings.s3_endpoint_url:
        opts["AWS_ENDPOINT_URL"] = settings.s3_endpoint_url
        opts["AWS_ALLOW_HTTP"] = str(settings.s3_endpoint_url.startswith("http://")).lower()
    return opts


def split_partitions(
    table: pa.Table, partition_by: Sequence[str]
) -> list[tuple[list[tuple[str, str | None]], pa.Table]]:
    """(partition values as Delta strings, the rows without partition columns), one per
    distinct value, in a fixed order (so reruns name and fill the same files)."""
    if not partition_by:
        return [([], table)]
    keys = table.select(list(partition_by)).to_pylist()
    groups: dict[tuple[str | None, ...], list[int]] = {}
    for i, row in enumerate(keys):
        groups.setdefault(tuple(partition_value(row[c]) for c in partition_by), []).append(i)
    rest = table.drop_columns(list(partition_by))
    order = sorted(groups, key=lambda vs: [(v is None, v or "") for v in vs])
    return [(list(zip(partition_by, vs, strict=True)), rest.take(groups[vs])) for vs in order]


def partition_value(value: Any) -> str | None:
    """A partition value as the Delta log writes it (a string; None for null)."""
    if value is None:
        return None
    if isinstance(value, bool):
        return "true" if value else "false"
    if hasattr(value, "isoformat"):
        return value.isoformat()
    return str(value)


def partition_dir(value: str | None) -> str:
    return NULL_PARTITION if value is None else quote(value, safe="")


def file_stats(table: pa.Table) -> dict[str, Any]:
    """Delta file statistics (numRecords; min, max and null counts of integer and short
    string columns) so readers can skip files."""
    mins, maxs, nulls = {}, {}, {}
    for name, col in zip(table.column_names, table.columns, strict=True):
        t = col.type
        if not (pa.types.is_integer(t) or pa.types.is_string(t)):
            continue
        nulls[name] = col.null_count
        if col.null_count == len(col):
            continue
        lo, hi = (v.as_py() for v in pc.min_max(col).values())
        if isinstance(lo, str) and (len(lo) > 32 or len(hi) > 32):
            continue  # readers truncate long strings; better no bound than a wrong one
        mins[name], maxs[name] = lo, hi
    return {"numRecords": table.num_rows, "minValues": mins, "maxValues": maxs,
            "nullCount": nulls}  # fmt: skip


def add_action(file: Mapping[str, Any]) -> Any:
    from deltalake.transaction import AddAction

    return AddAction(
        path=file["path"],
        size=int(file["size"]),
        partition_values=dict(file["partition_values"]),
        modification_time=int(time.time() * 1000),
        data_change=True,
        stats=file["stats"],
    )


def staged_files(store: ObjectStore, key: str) -> list[dict[str, Any]]:
    """The files one instance staged (its index in the checkpoint store)."""
    return list(json.loads(store.get(key))["files"])
