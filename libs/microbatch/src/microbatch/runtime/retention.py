"""Step 6 of the protocol: retention of checkpoints and of each batch's objects.

Checkpoint retention (manifests, state files) is :func:`collect_garbage`'s. Then every
per-batch object older than the oldest retained checkpoint goes — run spec, plan,
published mark — and staged Kafka output once it is published (a rerun's publish needs it
until then). Pending enrichment files go by reference, like state files: one no retained
manifest names is deleted once no attempt can still be writing it (its batch is at most
the newest), and only when GC found nothing committed or rewinding meanwhile (a rewind's
copy keeps naming its source's file: see :mod:`microbatch.checkpoint.gc`).

Before a batch's published mark goes, each sink drops what attempts that lost the commit
(a retry's twin, a fenced zombie) left of that batch in its own storage
(:meth:`~microbatch.sinks.base.Sink.collect_orphans`): by then the batch has long been
published, so the sink knows exactly which of its files count. The order is

1. delete the batch's plan (and its other objects but the mark),
2. let the sinks collect the batch's orphans,
3. delete the published mark, last: a crash before it makes the next GC collect again.

Step 1 before step 2 is the retention half of a handshake with an attempt that stages
*later* (a zombie whose stage-2 tasks still run): such a stager that checks, after
writing, that its batch's plan still exists — and deletes what it wrote if not — either
finds the plan gone, or wrote before step 2 listed the batch's files. Without that check
on the sink's side, a part written after step 2 is an orphan no reader ever sees.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from microbatch.checkpoint.gc import collect_garbage, is_settled
from microbatch.checkpoint.layout import Layout
from microbatch.runtime.publish import is_published
from microbatch.runtime.records import BatchRecord
from microbatch.storage import ObjectStore


def collect_batch_garbage(
    store: ObjectStore,
    layout: Layout,
    retain_checkpoints: int,
    before_dropping: Callable[[Sequence[int]], None] | None = None,
) -> None:
    """Apply retention; ``before_dropping(batch_ids)`` runs before the published marks of
    those (published, no longer retained) batches are deleted, after their plans were."""
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
    unreferenced_pending: list[str] = []
    marks: list[str] = []
    dropped: set[int] = set()  # every published batch has a mark: those whose mark goes
    for prefix in layout.per_batch_prefixes():
        for key in store.list(prefix):
            batch = layout.batch_of(key)
            if batch is None:
                continue
            if prefix == layout.pending:
                if key not in pending_in_use and batch <= newest:
                    unreferenced_pending.append(key)
                continue
            if prefix == layout.staging:
                if batch > newest:
                    continue
                if batch == newest:
                    if newest_published is None:
                        newest_published = is_published(store, layout, newest)
                    if not newest_published:
                        continue
            elif batch >= oldest:
                continue
            if prefix == layout.published:
                marks.append(key)
                dropped.add(batch)
            else:
                doomed.append(key)
    if unreferenced_pending:
        settled = kept.settled if kept.settled is not None else is_settled(store, layout, newest)
        if settled:
            doomed += unreferenced_pending
    for key in doomed:  # Step 1
        store.delete(key)
    if dropped and before_dropping is not None:  # Step 2
        before_dropping(sorted(dropped))
    for key in marks:  # Step 3
        store.delete(key)
