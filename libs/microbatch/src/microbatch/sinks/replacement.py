"""Which undone batches a new batch replaces, for sinks whose output can be retracted.

A rewind (``microbatch replay``, an Airflow backfill) undoes batches whose output stays
visible until batches that read their input again replace it. Each later batch records its
end offsets and *supersedes* every undone batch whose input it has now read again (end
offsets of the undone batch <= its own, on every partition). The undone batches still
awaiting replacement travel from checkpoint to checkpoint in the batch record.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from microbatch.sinks.base import Awaiting


def after_batch(
    awaiting: Mapping[str, Any], end_offsets: Mapping[str, int]
) -> tuple[list[int], Awaiting]:
    """(superseded, still awaiting) once a batch ending at ``end_offsets`` is published:
    it replaces every awaiting batch whose input it has read again."""
    done = sorted(int(b) for b, ends in awaiting.items() if covers(end_offsets, ends))
    rest = {b: ends for b, ends in awaiting.items() if int(b) not in done}
    return done, rest


def covers(ends: Mapping[str, int], undone_ends: Mapping[str, int] | None) -> bool:
    """Has a batch ending at ``ends`` read again all the input of an undone batch?"""
    if undone_ends is None:
        return False
    return all(ends.get(tp, -1) >= end for tp, end in undone_ends.items())
