"""A pipeline's state for the page, as plain dicts (no secrets: URLs, ids and numbers)."""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Collection, Mapping
from typing import Any

from microbatch.settings import Settings

EndOffsets = Callable[[Collection[Any]], Mapping[Any, int]]
RECENT = 12


def kafka_end_offsets(settings: Settings, timeout_s: float = 5.0) -> EndOffsets:
    """End offsets from the brokers (one short-lived, closed consumer per call)."""
    from microbatch.kafka import KafkaBrokerView

    def end_offsets(tps: Collection[Any]) -> Mapping[Any, int]:
        with KafkaBrokerView.for_settings(settings, timeout_s=timeout_s) as view:
            return view.end_offsets(list(tps))

    return end_offsets


def fmt_ms(ms: int | None) -> str:
    if ms is None:
        return "-"
    return dt.datetime.fromtimestamp(ms / 1000, dt.UTC).isoformat(timespec="seconds")


def pipeline_view(
    name: str,
    checkpoints_url: str,
    settings: Settings,
    end_offsets: EndOffsets,
    topics: Collection[str] = (),
    recent: int = RECENT,
) -> dict[str, Any]:
    """Checkpoints, lag, watermark, timings and state size per key-group of the pipeline
    whose checkpoints are at ``checkpoints_url``: stored facts only, no job file loaded
    (``topics``: its source topics if known; else those of its newest checkpoint)."""
    from microbatch.checkpoint import Layout, list_checkpoints, load_manifest
    from microbatch.runtime.records import BatchRecord, BatchStats
    from microbatch.storage import open_store

    store = open_store(checkpoints_url, settings)
    layout = Layout()
    ids = list_checkpoints(store, layout)
    view: dict[str, Any] = {
        "name": name,
        "checkpoints_url": checkpoints_url,
        "topics": list(topics),
        "max_parallelism": None,
        "checkpoints": [],
        "partitions": [],
        "timings": [],
        "key_groups": [],
        "latest": None,
        "errors": [],
    }
    if not ids:
        return view
    manifests = [load_manifest(store, layout, cid) for cid in ids[-recent:]]
    previous_ms: int | None = None
    for m in manifests:
        record = BatchRecord.of(m)
        stats = record.stats or BatchStats()
        at_ms = None if record.batch is None else record.batch.processing_time_ms
        view["checkpoints"].append(
            {
                "id": m.checkpoint_id,
                "created_at": m.created_at,
                "parallelism": m.parallelism,
                "records_in": stats.records_in,
                "dead_letters": stats.dead_letters,
                "state_bytes": m.total_bytes,
                "state_keys": m.total_keys,
                "full": m.full_checkpoint_id == m.checkpoint_id,
                "replayed": record.batch is not None and record.batch.replayed,
            }
        )
        view["timings"].append(_timing(m.checkpoint_id, stats, at_ms, previous_ms))
        previous_ms = at_ms if at_ms is not None else previous_ms
    view["checkpoints"].reverse()  # newest first
    view["timings"].reverse()
    latest = manifests[-1]
    latest_record = BatchRecord.of(latest)
    view["max_parallelism"] = latest.max_parallelism
    if not view["topics"]:
        view["topics"] = sorted({tp.topic for tp in latest_record.offsets})
    view["latest"] = {
        "id": latest.checkpoint_id,
        "created_at": latest.created_at,
        "watermark": latest_record.watermark,
        "watermark_iso": fmt_ms(latest_record.watermark),
        "parallelism": latest.parallelism,
        "max_parallelism": latest.max_parallelism,
        "state_bytes": latest.total_bytes,
        "state_keys": latest.total_keys,
    }
    view["key_groups"] = [
        {"key_group": kg, "bytes": size, "keys": keys}
        for kg, (size, keys) in enumerate(latest.key_group_sizes())
    ]
    view["partitions"], error = _partitions(latest_record.offsets, end_offsets)
    if error:
        view["errors"].append(error)
    return view


def _timing(cid: int, stats: Any, at_ms: int | None, previous_ms: int | None) -> dict[str, Any]:
    """Per batch (``stats``: its ``BatchStats``): the slowest instance's phases (the
    batch's critical path on Spark)."""
    instances = stats.instances
    slowest: Mapping[str, float] = {}
    for inst in instances:
        secs = inst.seconds
        if sum(secs.values()) >= sum(slowest.values()):
            slowest = secs
    return {
        "id": cid,
        "at": fmt_ms(at_ms),
        "since_previous_s": None
        if at_ms is None or previous_ms is None
        else round((at_ms - previous_ms) / 1000, 1),
        "records_in": stats.records_in,
        "batch_s": stats.seconds.get("to_commit"),
        "instances": len(instances),
        "slowest_instance_s": round(sum(slowest.values()), 3),
        "phases": {k: round(v, 3) for k, v in slowest.items()},
    }


def _partitions(
    committed: Mapping[Any, int], end_offsets: EndOffsets
) -> tuple[list[dict[str, Any]], str | None]:
    from microbatch.kafka import partition_lag

    try:
        end = dict(end_offsets(sorted(committed)))
        error = None
    except Exception as exc:  # the page still shows the checkpoints
        end, error = {}, f"lag unavailable: {exc}"
    lag = partition_lag(end, committed) if end else {}
    rows = [
        {
            "partition": str(tp),
            "committed": committed[tp],
            "end": end.get(tp),
            "lag": lag.get(tp),
        }
        for tp in sorted(committed)
    ]
    return rows, error
