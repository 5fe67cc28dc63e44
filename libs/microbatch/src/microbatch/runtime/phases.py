"""Where a batch stands, derived from the store alone — what recovery matches on.

A batch moves through these phases, each marked by an object the protocol writes::

    NEW ──plan──▶ PLANNED ──execute──▶ EXECUTED ──commit──▶ COMMITTED ──publish──▶ PUBLISHED
                  plans/<id>           state/<id>/…         manifests/<id>         published/<id>

A crash leaves the batch in the last phase it reached, and the next run continues from
there: PLANNED and EXECUTED replay the stored plan (state files of an attempt that did not
commit are never referenced, and GC removes them); COMMITTED publishes; PUBLISHED is done.
"""

from __future__ import annotations

import enum

from microbatch.checkpoint import Layout
from microbatch.storage import ObjectStore


class Phase(enum.Enum):
    NEW = "new"
    PLANNED = "planned"
    EXECUTED = "executed"
    COMMITTED = "committed"
    PUBLISHED = "published"


def phase_of(store: ObjectStore, layout: Layout, batch_id: int) -> Phase:
    """The phase batch ``batch_id`` reached (a retained batch's; GC removes the marks of
    older ones)."""
    if store.exists(layout.manifest_key(batch_id)):
        if store.exists(layout.published_key(batch_id)):
            return Phase.PUBLISHED
        return Phase.COMMITTED
    if not store.exists(layout.plan_key(batch_id)):
        return Phase.NEW
    if store.list(f"{layout.state}{batch_id:020d}/"):
        return Phase.EXECUTED
    return Phase.PLANNED
