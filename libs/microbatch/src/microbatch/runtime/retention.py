"""Step 6 of the protocol: retention of checkpoints and of each batch's objects.

Checkpoint retention (manifests, state files) is :func:`collect_garbage`'s. Then every
per-batch object older than the oldest retained checkpoint goes — run spec, plan, pending
inputs, published mark — and staged Kafka output once it is published (a rerun's publish
needs it until then).
"""

from __future__ import annotations

from microbatch.checkpoint import Layout, collect_garbage
from microbatch.runtime.publish import is_published
from microbatch.storage import ObjectStore


def collect_batch_garbage(store: ObjectStore, layout: Layout, retain_checkpoints: int) -> None:
    kept = collect_garbage(store, layout, retain_checkpoints)
    if not kept.retained:
        return
    oldest, newest = kept.retained[0], kept.retained[-1]
    newest_published = None  # asked once, only if the newest batch's staging is listed
    for prefix in layout.per_batch_prefixes():
        staging = prefix == layout.staging
        for key in store.list(prefix):
            batch = layout.batch_of(key)
            if batch is None or batch >= (newest + 1 if staging else oldest):
                continue
            if staging and batch == newest:
                if newest_published is None:
                    newest_published = is_published(store, layout, newest)
                if not newest_published:
                    continue
            store.delete(key)
