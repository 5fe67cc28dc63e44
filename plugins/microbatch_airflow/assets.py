"""One Airflow asset per pipeline; one asset event per committed batch.

The asset is ``microbatch://<pipeline>`` (name ``microbatch.<pipeline>``). A DAG scheduled
on it runs after each committed batch; the event's ``extra`` says which batch it was.
"""

from __future__ import annotations

from typing import Any

ASSET_SCHEME = "microbatch"


def asset_uri(pipeline: str) -> str:
    return f"{ASSET_SCHEME}://{pipeline}"


def pipeline_asset(pipeline: str) -> Any:
    """The :class:`airflow.sdk.Asset` a pipeline's batch task emits to."""
    from airflow.sdk import Asset

    return Asset(name=f"{ASSET_SCHEME}.{pipeline}", uri=asset_uri(pipeline), group="microbatch")


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
