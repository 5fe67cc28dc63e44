"""What the Iceberg sink records in its snapshots' summaries, and how it reads it back.

Every snapshot the sink commits names its app, ``<pipeline>/<sink>``:

=========================== ============================= ===================================
key                         in the snapshot of            value
=========================== ============================= ===================================
``microbatch.app``          every one                     the app
``microbatch.batch``        a batch, a rewind             the batch (checkpoint) id
``microbatch.end-offsets``  a batch                       what it read: ``{"t:0": 5120}``
``microbatch.supersedes``   a batch                       the undone batches it replaces
``microbatch.undoes``       a rewind                      the batches the rewind undoes
``microbatch.published``    an optimize                   every app's newest batch then
``microbatch.optimize``     an optimize                   what it merged
=========================== ============================= ===================================

Publishing asks the history one question: the app's newest batch in the current snapshot's
ancestry (:func:`committed_batch`), answered by the newest snapshot that names one of the
app's batches, or by an optimize's snapshot, which carries every app's answer
(``published``). :func:`published_marks` says how far back the answers lie: an expiry that
keeps those snapshots (and their descendants on the way to the current one) changes no
answer, whatever else it removes.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from typing import Any

__all__ = [
    "APP",
    "BATCH",
    "END_OFFSETS",
    "OPTIMIZE",
    "PUBLISHED",
    "SUPERSEDES",
    "UNDOES",
    "committed_batch",
    "lineage",
    "published_marks",
]

APP, BATCH, END_OFFSETS = "microbatch.app", "microbatch.batch", "microbatch.end-offsets"
SUPERSEDES, UNDOES = "microbatch.supersedes", "microbatch.undoes"
PUBLISHED, OPTIMIZE = "microbatch.published", "microbatch.optimize"


def lineage(table: Any) -> Iterator[tuple[Any, Mapping[str, Any]]]:
    """(snapshot, its summary's properties) of the current snapshot and its ancestors,
    newest first; the walk ends where a parent was expired."""
    from pyiceberg.table.snapshots import ancestors_of

    for snapshot in ancestors_of(table.current_snapshot(), table.metadata):
        yield snapshot, snapshot.summary.additional_properties if snapshot.summary else {}


def answers(summary: Mapping[str, Any]) -> dict[str, int]:
    """app → its newest batch, as far as this snapshot's summary says."""
    out: dict[str, int] = {}
    if PUBLISHED in summary:
        out.update({str(app): int(b) for app, b in json.loads(summary[PUBLISHED]).items()})
    if summary.get(APP) is not None and summary.get(BATCH) is not None:
        out[str(summary[APP])] = int(summary[BATCH])
    return out


def committed_batch(table: Any, app_id: str) -> int | None:
    """The newest batch ``app_id`` committed in the current lineage, None if none."""
    for _, summary in lineage(table):
        found = answers(summary).get(app_id)
        if found is not None:
            return found
    return None


def published_marks(table: Any) -> tuple[dict[str, int], list[int]]:
    """(every app's newest batch in the current lineage, the ids of the snapshots from the
    current one down to the oldest that gives one of those answers, newest first)."""
    marks: dict[str, int] = {}
    chain: list[int] = []
    needed = 0
    for snapshot, summary in lineage(table):
        chain.append(snapshot.snapshot_id)
        for app, batch in answers(summary).items():
            if app not in marks:
                marks[app] = batch
                needed = len(chain)
    return marks, chain[:needed]
