"""One checkpoint in detail, for the drill-down page: what its manifest records.

Everything is read from the pipeline's checkpoint store with the library's readers
(``load_manifest``, ``BatchRecord.of``), never from a job file. The offset ranges a batch
read come from its stored plan (``plans/<id>.json``: written before the batch read
anything, so it is exactly what was read) when that plan is still there and is the one
the checkpoint committed; otherwise from the offsets of the checkpoint the batch started
from (``batch.base_checkpoint``; the first batch records its own ``from_offsets``), plus
the offsets retention made it skip. A rewind's or reshard's copy read nothing itself.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from microbatch.settings import Settings
from microbatch_airflow.ui.data import fmt_ms

if TYPE_CHECKING:  # the library's readers are imported where they are used
    from microbatch.checkpoint import Layout
    from microbatch.kafka.offsets import TopicPartition
    from microbatch.kafka.planner import BatchPlan
    from microbatch.runtime.records import BatchRecord
    from microbatch.storage import ObjectStore


class PageError(Exception):
    """What a page cannot show; the message names the pipeline, checkpoint or DAG and
    says what to do. ``status`` is the HTTP status it is answered with."""

    status = 500


class NotFound(PageError):
    """An unknown pipeline, checkpoint or DAG."""

    status = 404


class Unreadable(PageError):
    """The checkpoint store could not be read (the store, not the request, is at fault)."""

    status = 502


def parse_checkpoint_id(pipeline: str, raw: str) -> int:
    """A checkpoint id from a URL segment (``NotFound`` for anything else)."""
    if not raw.isascii() or not raw.isdigit():
        raise NotFound(
            f"pipeline {pipeline!r} has no checkpoint {raw!r}: a checkpoint id is a "
            "non-negative integer (the ids are listed on the pipeline's Microbatch page)"
        )
    return int(raw)


def checkpoint_view(
    pipeline: str, checkpoints_url: str, checkpoint_id: int, settings: Settings
) -> dict[str, Any]:
    """What checkpoint ``checkpoint_id`` of ``pipeline`` records, as plain dicts (URLs,
    ids and numbers only); ``NotFound`` when it is not committed (or no longer retained)."""
    from microbatch.checkpoint import Layout, list_checkpoints, load_manifest
    from microbatch.runtime.records import BatchRecord
    from microbatch.storage import open_store

    store = open_store(checkpoints_url, settings)
    layout = Layout()
    ids = list_checkpoints(store, layout)
    if checkpoint_id not in ids:
        retained = f"{ids[0]}–{ids[-1]}" if ids else "none yet"
        raise NotFound(
            f"pipeline {pipeline!r} has no checkpoint {checkpoint_id} in {checkpoints_url} "
            f"(its committed checkpoints: {retained}; retention removes the oldest). "
            "Pick a checkpoint from the pipeline's list on the Microbatch page."
        )
    manifest = load_manifest(store, layout, checkpoint_id)
    record = BatchRecord.of(manifest)
    ranges, ranges_from = offset_ranges(store, layout, checkpoint_id, record)
    earlier = [i for i in ids if i < checkpoint_id]
    later = [i for i in ids if i > checkpoint_id]
    return {
        "pipeline": pipeline,
        "checkpoints_url": checkpoints_url,
        "id": checkpoint_id,
        "previous": earlier[-1] if earlier else None,
        "next": later[0] if later else None,
        "created_at": manifest.created_at,
        "parallelism": manifest.parallelism,
        "max_parallelism": manifest.max_parallelism,
        "full_checkpoint_id": manifest.full_checkpoint_id,
        "state_bytes": manifest.total_bytes,
        "state_keys": manifest.total_keys,
        "watermark": record.watermark,
        "watermark_iso": fmt_ms(record.watermark),
        "batch": _batch(record),
        "ranges": ranges,
        "ranges_from": ranges_from,
        "offsets": [
            {"topic": tp.topic, "partition": tp.partition, "offset": offset}
            for tp, offset in sorted(record.offsets.items())
        ],
        "enrich_pending": 0 if record.enrich_pending is None else record.enrich_pending.count,
        "stats": _stats(record),
        "rewind": _rewind(record),
    }


def offset_ranges(
    store: ObjectStore, layout: Layout, checkpoint_id: int, record: BatchRecord
) -> tuple[list[dict[str, Any]], str]:
    """The ``[from, until)`` ranges the batch read (partitions it read nothing of are
    left out, as in its plan), and where the ``from`` offsets come from."""
    from microbatch.kafka.offsets import snapshot_from_json
    from microbatch.runtime.watermark import partition_name

    if record.replayed_from is not None or record.resharded_from is not None:
        return [], "none: a copy made by a rewind or reshard reads no records"
    until = dict(record.offsets)
    plan = _stored_plan(store, layout, checkpoint_id)
    skipped: Mapping[TopicPartition, int]
    if plan is not None and plan.end_offsets() == until:
        start, skipped, source = dict(plan.start_offsets), plan.skipped, "the batch's stored plan"
    else:
        start, source = _start_from_lineage(store, layout, record)
        skipped = snapshot_from_json(record.stats.skipped) if record.stats else {}
        start = {tp: offset + skipped.get(tp, 0) for tp, offset in start.items()}
    counts = record.stats.per_partition if record.stats else {}
    rows = []
    for tp, end in sorted(until.items()):
        begin = start.get(tp)
        if begin == end:
            continue
        read = counts.get(partition_name(tp.topic, tp.partition))
        rows.append(
            {
                "topic": tp.topic,
                "partition": tp.partition,
                "from": begin,
                "until": end,
                "offsets": None if begin is None else end - begin,
                "records": None if read is None else read.inputs,
                "dead_letters": None if read is None else read.dead_letters,
                "skipped": skipped.get(tp, 0),
            }
        )
    return rows, source


def _stored_plan(store: ObjectStore, layout: Layout, checkpoint_id: int) -> BatchPlan | None:
    """The batch's stored plan, or None (removed by retention, or unreadable)."""
    from microbatch.errors import SourceError
    from microbatch.kafka.planner import PlanStore

    try:
        return PlanStore(store, layout.prefix).load(checkpoint_id)
    except SourceError:  # a corrupt plan: fall back to the checkpoints
        return None


def _start_from_lineage(
    store: ObjectStore, layout: Layout, record: BatchRecord
) -> tuple[dict[TopicPartition, int], str]:
    """Where the batch started: the offsets of the checkpoint it started from."""
    from microbatch.checkpoint import load_manifest
    from microbatch.errors import CheckpointError
    from microbatch.kafka.offsets import snapshot_from_json
    from microbatch.runtime.records import BatchRecord

    info = record.batch
    if info is None:
        return {}, "unknown: the checkpoint records no batch"
    if info.base_checkpoint is None:
        if info.from_offsets is None:
            return {}, "unknown: the first batch recorded no starting offsets"
        return snapshot_from_json(info.from_offsets), "the first batch's starting offsets"
    try:
        base = load_manifest(store, layout, info.base_checkpoint)
    except CheckpointError:
        return {}, f"unknown: checkpoint {info.base_checkpoint}, where the batch started, is gone"
    return dict(BatchRecord.of(base).offsets), f"checkpoint {info.base_checkpoint}'s offsets"


def _batch(record: BatchRecord) -> dict[str, Any] | None:
    info = record.batch
    if info is None:
        return None
    return {
        "run_id": info.run_id,
        "parallelism": info.parallelism,
        "planned_at": fmt_ms(info.processing_time_ms),
        "interval_start": _iso(info.interval_start_ms),
        "interval_end": _iso(info.until_timestamp_ms),
        "ends_exactly": info.ends_exactly,
        "base_checkpoint": info.base_checkpoint,
        "replayed": info.replayed,
    }


def _iso(ms: int | None) -> str | None:
    return None if ms is None else fmt_ms(ms)


def _stats(record: BatchRecord) -> dict[str, Any] | None:
    stats = record.stats
    if stats is None:
        return None
    return {
        "records_in": stats.records_in,
        "dead_letters": stats.dead_letters,
        "dead_letter_reasons": dict(stats.dead_letter_reasons),
        "outputs": dict(stats.outputs),
        "enrich_pending": stats.enrich_pending,
        "enrich_reissued": stats.enrich_reissued,
        "reader": stats.reader,
        "seconds": {k: round(v, 3) for k, v in stats.seconds.items()},
        "instances": [
            {
                "instance": inst.instance,
                "seconds": {k: round(v, 3) for k, v in inst.seconds.items()},
                "counters": dict(inst.counters),
            }
            for inst in stats.instances
        ],
    }


def _rewind(record: BatchRecord) -> dict[str, Any]:
    replayed, resharded = record.replayed_from, record.resharded_from
    awaiting = record.awaiting_replacement
    return {
        "copy_of": record.source_of_copy,
        "replayed_from": None
        if replayed is None
        else {"checkpoint_id": replayed.checkpoint_id, "undone": list(replayed.undone)},
        "resharded_from": None
        if resharded is None
        else {
            "checkpoint_id": resharded.checkpoint_id,
            "max_parallelism": resharded.max_parallelism,
        },
        "supersedes": None if record.supersedes is None else list(record.supersedes),
        "awaiting_replacement": None
        if awaiting is None
        else [
            {"batch": int(batch), "ends": None if ends is None else dict(ends)}
            for batch, ends in sorted(awaiting.items(), key=lambda item: int(item[0]))
        ],
    }
