"""Step 6 of the protocol: retention of checkpoints and of each batch's objects.

Checkpoint retention (manifests, state files) is :func:`collect_garbage`'s. Then every
per-batch object older than the oldest retained checkpoint goes — run spec, plan,
published mark — and staged Kafka output once it is published (a rerun's publish needs it
until then). Pending enrichment files go by reference, like state files: one no retained
manifest names is deleted once no attempt can still be writing it (its batch is at most
the newest); a rewind's copy keeps naming its source's file, which then stays.

Before a batch's last objects go, each sink drops what attempts that lost the commit (a
retry's twin, a fenced zombie) left of that batch in its own storage
(:meth:`~microbatch.sinks.base.Sink.collect_orphans`): by then the batch has long been
published, so the sink knows exactly which of its files count. A zombie that writes even
later leaves an orphan no reader ever sees (readers follow the commits).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from microbatch.checkpoint import Layout, collect_garbage
from microbatch.runtime.publish import is_published
from microbatch.runtime.records import BatchRecord
from microbatch.storage import ObjectStore


def collect_batch_garbage(
    store: ObjectStore,
    layout: Layout,
    retain_checkpoints: int,
    before_dropping: Callable[[Sequence[int]], None] | None = None,
) -> None:
    """Apply retention; ``before_dropping(batch_ids)`` runs before the objects of those
    (published, no longer retained) batches are deleted."""
    kept = collect_garbage(store, layout, retain_checkpoints)
    if not kept.retained:
        return
    oldest, newest = kept.retained[0], kept.retained[-1]
    pending_in_use = set()
    for manifest in kept.manifests:
        ref = BatchRecord.of(manifest).enrich_pending
        if ref is not None:
            pending_in_use.add(ref.file)
    newest_published = None  # asked once, only if the newest batch's staging is listed
    doomed: list[str] = []
    dropped: set[int] = set()  # every published batch has a mark: those whose mark goes
    for prefix in layout.per_batch_prefixes():
        for key in store.list(prefix):
            batch = layout.batch_of(key)
            if batch is None:
                continue
            if prefix == layout.pending:
                if key in pending_in_use or batch > newest:
                    continue
            elif prefix == layout.staging:
                if batch > newest:
                    continue
                if batch == newest:
                    if newest_published is None:
                        newest_published = is_published(store, layout, newest)
                    if not newest_published:
                        continue
            elif batch >= oldest:
                continue
            doomed.append(key)
            if prefix == layout.published:
                dropped.add(batch)
    if dropped and before_dropping is not None:
        before_dropping(sorted(dropped))
    for key in doomed:
        store.delete(key)
