"""Rewinds: commit a copy of an older position as the newest checkpoint.

The batches after the copy read their records again (``microbatch replay``, and a backfill
of an interval the pipeline already went past: :mod:`.rewind` finds the position). The
copy keeps the source's state, offsets, watermark and pending enrichment, and its batch
record (it stands for the source in the lineage), plus where it came from
(:class:`ReplayOrigin`) and which undone batches' output awaits replacement. Retractable
sinks replace the undone output as later batches recompute it; output that cannot be
retracted (Kafka) is refused unless the caller accepts repeats.

The copy names the source's state (and pending enrichment) files, which GC deletes once
no retained checkpoint names them — possibly a stalled run's GC that listed the
checkpoints before this rewind began. So a rewind pins its source (``pins/``) and reads
it again before committing: if the source is still there, any GC that removes it lists
the pins afterwards and deletes no file (:mod:`microbatch.checkpoint.gc` argues why);
if it is gone, nothing is committed.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import logging
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

from microbatch.checkpoint import Layout, Manifest, commit_manifest
from microbatch.checkpoint.catalog import load_manifest
from microbatch.errors import CheckpointError, ConfigError, StorageError
from microbatch.kafka import KafkaBrokerView
from microbatch.runtime.faults import pause_if
from microbatch.runtime.fence import Lease
from microbatch.runtime.pipeline import Pipeline
from microbatch.runtime.publish import publish
from microbatch.runtime.records import BatchInfo, BatchRecord, ReplayOrigin
from microbatch.runtime.rewind import RewindTarget
from microbatch.settings import Settings
from microbatch.sinks.base import Awaiting
from microbatch.storage import ObjectStore

log = logging.getLogger(__name__)


def rewind(
    store: ObjectStore,
    layout: Layout,
    pipeline: Pipeline,
    settings: Settings,
    latest: Manifest,
    target: RewindTarget,
    accept_kafka_repeats: bool,
    held: Lease,
) -> Manifest:
    """Commit and publish a copy of ``target`` as the newest checkpoint (under the
    caller's lease, checked before the commit and the publish); the batches after it read
    their records again."""
    what = "rewinding to " + (
        "before the first batch"
        if target.manifest is None
        else f"checkpoint {target.checkpoint_id}"
    )
    refuse_repeats(pipeline, what, accept_kafka_repeats)
    where = f"pipeline {pipeline.name!r}: {what}"
    if target.manifest is not None and target.manifest.max_parallelism != pipeline.max_parallelism:
        raise ConfigError(
            f"{where}: that checkpoint has max_parallelism {target.manifest.max_parallelism}, "
            f"the pipeline now {pipeline.max_parallelism} (a reshard happened since). "
            "Processing cannot go back across a reshard."
        )
    check_source_retained(settings, where, target)
    copy_id = latest.checkpoint_id + 1
    if target.manifest is None:
        source = Manifest(
            checkpoint_id=copy_id,
            pipeline_fingerprint=pipeline.fingerprint(),
            max_parallelism=pipeline.max_parallelism,
            parallelism=pipeline.parallelism,
            key_groups=(None,) * pipeline.max_parallelism,
            full_checkpoint_id=copy_id,
            created_at="",
        )
        # Empty state at the first batch's starting offsets.
        record = BatchRecord(
            offsets=target.offsets,
            batch=BatchInfo(until_timestamp_ms=target.at_ms, base_checkpoint=None),
        )
    else:
        source = target.manifest
        # The batch record stays: the copy stands for its source in the lineage.
        record = dataclasses.replace(BatchRecord.of(source), sinks=None, stats=None)
    record = dataclasses.replace(
        record,
        replayed_from=ReplayOrigin(
            target.checkpoint_id, (target.undone_from, latest.checkpoint_id)
        ),
        supersedes=None,  # a rewind replaces nothing itself
        awaiting_replacement=scan_awaiting(
            pipeline, settings, range(target.undone_from, latest.checkpoint_id + 1)
        ),
    )
    manifest = dataclasses.replace(
        source,
        checkpoint_id=copy_id,
        created_at=dt.datetime.now(dt.UTC).isoformat(timespec="milliseconds"),
        metadata=record.to_json(),
    )
    with pinned(store, layout, where, target.manifest, copy_id):
        held.check("the rewind's commit")
        commit_manifest(store, layout, manifest)
    pause_if("after_rewind_commit", where)
    held.check("publishing the rewind")
    publish(store, layout, pipeline, settings, manifest)
    log.info("%s: committed checkpoint %s", where, manifest.checkpoint_id)
    return manifest


@contextmanager
def pinned(
    store: ObjectStore, layout: Layout, where: str, source: Manifest | None, copy_id: int
) -> Iterator[None]:
    """Hold a pin on ``source`` while its copy ``copy_id`` commits: pin it, then make sure
    it is still the committed checkpoint it was (a :class:`CheckpointError` if retention
    removed it meanwhile, before anything is committed). Unpinned on the way out; a pin
    left by a crash goes with the next GC that sees ``copy_id`` taken."""
    if source is None:  # the state before the first batch: no file to keep
        yield
        return
    pin = layout.pin_key(copy_id, source.checkpoint_id, uuid.uuid4().hex[:12])
    store.put(pin, b"")
    try:
        gone = (
            f"{where}: checkpoint {source.checkpoint_id} left retention while this run "
            "was rewinding to it"
        )
        todo = (
            "Nothing was committed; rewind to a checkpoint that is still retained "
            "(`microbatch checkpoints` lists them)"
        )
        try:
            again = load_manifest(store, layout, source.checkpoint_id)
        except CheckpointError as e:
            raise CheckpointError(f"{gone} (another run's GC removed it: {e}). {todo}") from e
        if again.to_json() != source.to_json():
            raise CheckpointError(f"{gone}: the manifest there is another one now. {todo}")
        yield
    finally:
        try:
            store.delete(pin)
        except StorageError as e:  # GC removes it once the copy's id is taken
            log.warning("%s: could not remove pin %s: %s", where, pin, e)


def scan_awaiting(pipeline: Pipeline, settings: Settings, undone: range = range(0)) -> Awaiting:
    """Undone batches whose output still awaits replacement, read from the sinks
    themselves (all of their history: for rewinds only), counting ``undone`` as undone."""
    out: Awaiting = {}
    for sink in pipeline.all_sinks():
        out.update(sink.awaiting_replacement(settings, undone))
    return dict(sorted(out.items(), key=lambda item: int(item[0])))


def awaiting_replacement(
    pipeline: Pipeline, settings: Settings, base: BatchRecord | None
) -> Awaiting:
    """Undone batches whose output still awaits replacement, as ``base`` recorded them."""
    if base is None:
        return {}
    if base.awaiting_replacement is not None:
        return dict(base.awaiting_replacement)
    return scan_awaiting(pipeline, settings)  # a checkpoint written before it was recorded


def refuse_repeats(pipeline: Pipeline, what: str, accept_kafka_repeats: bool) -> None:
    """A rewind publishes the undone batches' output again: refuse it for sinks that
    cannot retract theirs, unless the caller accepts repeats."""
    kafka = [s.name for s in pipeline.all_sinks() if not s.retractable]
    if kafka and not accept_kafka_repeats:
        raise ConfigError(
            f"pipeline {pipeline.name!r}: {what} will publish the outputs of the undone "
            f"batches again to Kafka sinks {kafka} (Kafka records cannot be retracted). "
            "Pass --accept-kafka-repeats (Airflow: kafka_repeats_on_backfill=True) if "
            "consumers of those topics deduplicate (e.g. by key)."
        )


def check_source_retained(settings: Settings, where: str, target: RewindTarget) -> None:
    """Refuse a rewind whose records Kafka no longer has (retention or compaction
    deleted them): the reprocessed intervals would silently miss them."""
    offsets = target.offsets
    if not offsets:
        return
    with KafkaBrokerView.for_settings(settings) as view:
        earliest = view.beginning_offsets(list(offsets))
    gone = {tp: (n, earliest[tp]) for tp, n in offsets.items() if earliest.get(tp, 0) > n}
    if gone:
        listed = ", ".join(
            f"{tp.topic}[{tp.partition}] needs offset {n}, earliest kept is {first}"
            for tp, (n, first) in sorted(gone.items())
        )
        raise ConfigError(
            f"{where}: Kafka no longer has the records to reprocess ({listed}); the "
            "topic's retention deleted them. Backfill only intervals whose records are "
            "still in Kafka."
        )
