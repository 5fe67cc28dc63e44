"""Where a backfill starts: the checkpoint that ended at its first interval's start.

A batch run for the data interval ``[start, end)`` reads the records up to ``end``. When
the pipeline has already gone past ``start`` (an Airflow backfill of past intervals, or a
rerun of a whole backfill), the batch must first *rewind* to the checkpoint as of
``start``: the checkpoint whose batch read up to exactly ``start``. This module finds it
by walking the pipeline's lineage backwards from the newest checkpoint; it is pure (the
caller passes a loader), so its rules are unit-tested without services.

The lineage of a checkpoint: a batch's checkpoint follows the checkpoint it started from
(``batch.base_checkpoint``). A replay or reshard checkpoint is a copy of its source and
carries the source's batch record, so it stands for the source even once retention has
removed the source.

Only a batch that stopped exactly at its interval end on every partition counts
(``ends_exactly``: not one capped by a record limit, nor one that started past its end).
The state *before* the first batch (empty state, the first batch's starting offsets) is a
valid target too, for any ``start`` up to the first batch's interval start: the first
batch read everything before its end, so a backfill from an earlier interval starts from
the beginning. That is what lets a backfill from the DAG's first interval run again.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
from collections.abc import Callable, Mapping

from microbatch.checkpoint import Manifest
from microbatch.errors import CheckpointError
from microbatch.kafka.offsets import TopicPartition, snapshot_from_json
from microbatch.runtime.records import BatchInfo, BatchRecord

Loader = Callable[[int], Manifest | None]
"""Committed checkpoint by id, or None when it no longer exists (retention)."""


@dataclasses.dataclass(frozen=True)
class RewindTarget:
    """The pipeline's position as of a time: a committed checkpoint, or (``manifest`` is
    None) the position before the first batch, at ``offsets`` with empty state."""

    manifest: Manifest | None
    offsets: Mapping[TopicPartition, int]
    undone_from: int  # the first checkpoint id the rewind undoes
    at_ms: int | None = None  # the time it stands for (an interval start), when known

    @property
    def checkpoint_id(self) -> int | None:
        return None if self.manifest is None else self.manifest.checkpoint_id


def batch_info(m: Manifest) -> BatchInfo | None:
    return BatchRecord.of(m).batch


def batch_end_ms(m: Manifest) -> int | None:
    """How far a batch read, in record time: its interval end, else when it was planned
    (a run without an end reads to the end of the log)."""
    info = batch_info(m)
    return None if info is None else info.end_ms


def find_rewind_target(
    pipeline: str, latest: Manifest | None, start_ms: int, load: Loader
) -> RewindTarget | None:
    """The position to rewind to before a batch of the interval starting at ``start_ms``,
    or None when no rewind is needed (the pipeline is at or before ``start_ms``).

    Raises :class:`CheckpointError` when the pipeline went past ``start_ms`` but no
    checkpoint of its lineage ended exactly there (retention removed it, or batches never
    ended at that boundary)."""
    latest = _with_batch_info(latest, load)
    if latest is None:
        return None
    end = batch_end_ms(latest)
    if end is None or end <= start_ms:
        return None
    boundaries: list[int] = []
    cur: Manifest | None = latest
    while cur is not None:
        info = batch_info(cur)
        assert info is not None  # _with_batch_info found a manifest with one
        until = info.until_timestamp_ms
        if until is not None:
            boundaries.append(until)
        if until == start_ms and info.ends_exactly and cur is not latest:
            offsets = BatchRecord.of(cur).offsets
            return RewindTarget(cur, offsets, cur.checkpoint_id + 1, start_ms)
        if until is not None and until < start_ms:
            break
        if info.base_checkpoint is None:  # cur is the first batch: is the state before it?
            first_start = info.interval_start_ms
            first_start = info.end_ms if first_start is None else first_start
            if (
                first_start is not None
                and start_ms <= first_start
                and info.from_offsets is not None
            ):
                # Every output since the beginning is recomputed: undo from batch 0 on.
                return RewindTarget(None, snapshot_from_json(info.from_offsets), 0, start_ms)
            break
        cur = _with_batch_info(load(info.base_checkpoint), load)
    ends = ", ".join(_iso(b) for b in sorted(set(boundaries))) or "none with an interval end"
    raise CheckpointError(
        f"pipeline {pipeline!r} has processed past {_iso(start_ms)}, but no retained "
        "checkpoint ended there, so the interval starting then cannot be reprocessed. "
        f"Retained checkpoints end at: {ends}. Start the backfill at one of those times; an "
        "older checkpoint may have been removed by retention (the pipeline's "
        "retain_checkpoints)."
    )


def _with_batch_info(m: Manifest | None, load: Loader) -> Manifest | None:
    """``m``, or for a copy that does not carry its source's batch record (replays before
    copies carried it), the source it stands for."""
    while m is not None and batch_info(m) is None:
        source = BatchRecord.of(m).source_of_copy
        m = None if source is None else load(source)
    return m


def _iso(ms: int) -> str:
    return dt.datetime.fromtimestamp(ms / 1000, dt.UTC).isoformat(timespec="seconds")
