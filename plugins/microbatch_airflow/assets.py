"""One Airflow asset per pipeline; one asset event per committed batch.

The asset is ``microbatch://<pipeline>`` (name ``microbatch.<pipeline>``). A DAG scheduled
on it runs after each committed batch; the event's ``extra`` says which batch it was.

The batch task also emits, through the asset alias ``microbatch.<pipeline>.outputs``, one
event per output the batch wrote to: the sink's own URI — ``s3://bucket/path`` of a Delta
table or Parquet folder, ``file:///path`` locally, ``kafka://broker/topic`` — so a DAG can
be scheduled on the table it reads (``schedule=[Asset("s3://bucket/sessions")]``) without
knowing which pipeline fills it. The URIs are known only when the job reports them, hence
an alias rather than declared outlets.
"""

from __future__ import annotations

from typing import Any

ASSET_SCHEME = "microbatch"


def asset_uri(pipeline: str) -> str:
    return f"{ASSET_SCHEME}://{pipeline}"


def outputs_alias(pipeline: str) -> Any:
    """The :class:`airflow.sdk.AssetAlias` the batch task adds its outputs' events to."""
    from airflow.sdk import AssetAlias

    return AssetAlias(name=f"{ASSET_SCHEME}.{pipeline}.outputs", group="microbatch")


def output_uri(dataset: dict[str, Any]) -> str:
    """An output's asset URI from its lineage dataset (``namespace`` + ``name``)."""
    namespace, name = dataset["namespace"], dataset["name"]
    if namespace == "file":
        return f"file://{name}"
    return f"{namespace}/{name}"


def output_events(result: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(URI, extra) of each output a committed batch wrote rows to."""
    written = result.get("outputs") or {}
    events = []
    for dataset in (result.get("lineage") or {}).get("outputs", []):
        rows = written.get(dataset.get("sink"), 0)
        if rows:
            extra = {"pipeline": result.get("pipeline"), "batch_id": result.get("batch_id"),
                     "sink": dataset["sink"], "rows": rows}  # fmt: skip
            events.append((output_uri(dataset), extra))
    return events


def pipeline_asset(pipeline: str) -> Any:
    """The :class:`airflow.sdk.Asset` a pipeline's batch task emits to."""
    from airflow.sdk import Asset

    return Asset(name=f"{ASSET_SCHEME}.{pipeline}", uri=asset_uri(pipeline), group="microbatch")


def new_records_asset(pipeline: str, trigger: Any) -> Any:
    """The asset of an event-driven DAG: ``microbatch://<pipeline>/new-records``, watched
    by ``trigger`` (a :class:`~microbatch_airflow.triggers.NewRecordsTrigger`), which adds
    an event each time the pipeline's topics hold records past its newest checkpoint."""
    from airflow.sdk import Asset, AssetWatcher

    return Asset(
        name=f"{ASSET_SCHEME}.{pipeline}.new_records",
        uri=f"{asset_uri(pipeline)}/new-records",
        group="microbatch",
        watchers=[AssetWatcher(name=f"{ASSET_SCHEME}.{pipeline}.new_records", trigger=trigger)],
    )


def asset_event_extra(result: dict[str, Any]) -> dict[str, Any]:
    """The event's ``extra``: batch id, records, lag and watermark of a committed batch,
    and the pipeline's checkpoint location and source topics (for the Microbatch page)."""
    lag = result.get("lag") or {}
    lineage = result.get("lineage") or {}
    return {
        "pipeline": result.get("pipeline"),
        "batch_id": result.get("batch_id"),
        "records_in": result.get("records_in", 0),
        "dead_letters": result.get("dead_letters", 0),
        "outputs": result.get("outputs") or {},
        "watermark": result.get("watermark"),
        "lag": lag,
        "lag_total": sum(lag.values()),
        "parallelism": result.get("parallelism"),
        "replayed": bool(result.get("replayed")),
        # Where the Microbatch page reads the pipeline's checkpoints (it loads no job file).
        "checkpoints": lineage.get("checkpoints"),
        "topics": [d["name"] for d in lineage.get("inputs", [])],
    }
