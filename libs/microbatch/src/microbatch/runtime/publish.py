"""Step 5 of the protocol: make a committed batch's output visible, idempotently.

Publishing acts only on what the committed manifest's batch record names: each sink
publishes its staged output (:meth:`Sink.publish`), then the batch is marked published
(the layout's ``published/<id>``) and its end offsets are mirrored to the pipeline's
consumer group for lag tools. Every step may run again after a crash: sinks publish once.
"""

from __future__ import annotations

import logging

from microbatch.checkpoint import Layout, Manifest
from microbatch.errors import MicrobatchError
from microbatch.kafka import consumer_group_name, mirror_offsets
from microbatch.runtime.faults import crash_if
from microbatch.runtime.fence import Lease
from microbatch.runtime.phases import Phase, phase_of
from microbatch.runtime.pipeline import Pipeline
from microbatch.runtime.records import BatchRecord
from microbatch.runtime.watermark import partition_name
from microbatch.settings import Settings
from microbatch.sinks import PublishContext
from microbatch.storage import ObjectStore

log = logging.getLogger(__name__)


def is_published(store: ObjectStore, layout: Layout, batch_id: int) -> bool:
    return store.exists(layout.published_key(batch_id))


def recover(
    store: ObjectStore,
    layout: Layout,
    pipeline: Pipeline,
    settings: Settings,
    newest: Manifest,
    held: Lease,
    mirror: bool = True,
) -> bool:
    """Step 1: publish the newest checkpoint if a crash came between its commit and its
    publish (before anything builds on it: a batch, a rewind, a reshard); True if it did."""
    match phase_of(store, layout, newest.checkpoint_id):
        case Phase.COMMITTED:
            log.info(
                "pipeline %s: publishing committed batch %s", pipeline.name, newest.checkpoint_id
            )
            held.check("publishing")
            publish(store, layout, pipeline, settings, newest, mirror=mirror)
            return True
        case _:  # PUBLISHED
            return False


def publish(
    store: ObjectStore,
    layout: Layout,
    pipeline: Pipeline,
    settings: Settings,
    manifest: Manifest,
    crash_at: str | None = None,
    mirror: bool = True,
) -> None:
    """Publish committed checkpoint ``manifest`` (a batch, a rewind's or a reshard's copy);
    ``mirror``: also commit its offsets to the pipeline's consumer group."""
    batch_id = manifest.checkpoint_id
    record = BatchRecord.of(manifest)

    def context(sink_name: str) -> PublishContext:
        staged = (record.sinks or {}).get(sink_name, ())
        return PublishContext(
            pipeline=pipeline.name,
            batch_id=batch_id,
            settings=settings,
            checkpoint_store=store,
            layout=layout,
            staged=tuple(s for s in staged if s is not None),
            end_offsets={partition_name(*tp): n for tp, n in record.offsets.items()},
            supersedes=record.supersedes or (),
        )

    if record.resharded_from is not None:  # a reshard has no output of its own
        store.put(layout.published_key(batch_id), b"")
        return
    if record.replayed_from is not None:
        # A rewind: the output of the batches it undoes stays visible until the batches
        # that read their input again replace it (see sinks.replacement).
        first, last = record.replayed_from.undone
        for sink in pipeline.all_sinks():
            sink.publish_rewind(context(sink.name), range(first, last + 1))
        store.put(layout.published_key(batch_id), b"")
        return
    for n, sink in enumerate(pipeline.all_sinks()):
        sink.publish(context(sink.name))
        if n == 0:
            crash_if(crash_at, "during_publish", f"pipeline {pipeline.name!r} batch {batch_id}")
    store.put(layout.published_key(batch_id), b"")
    if not mirror:
        return
    try:
        mirror_offsets(
            settings.kafka_bootstrap_servers,
            consumer_group_name(pipeline.name),
            record.offsets,
            client_config=settings.kafka_client_config(),
        )
    except MicrobatchError as e:  # the mirror is informational; the manifest is truth
        log.warning("pipeline %s: could not mirror offsets: %s", pipeline.name, e)
