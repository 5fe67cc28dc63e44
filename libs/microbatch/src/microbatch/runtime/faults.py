"""Named crash points of the commit protocol, for crash tests and the demo.

A run given ``crash_at=<point>`` raises :class:`InjectedCrash` there — nothing is cleaned
up, exactly as if the process had died — and a rerun must then produce the same outputs
and state as a run without the crash.
"""

from __future__ import annotations

import logging
import os
import signal

from microbatch.errors import MicrobatchError

log = logging.getLogger(__name__)

CRASH_POINTS = (
    "after_plan",  # the plan is stored, nothing read
    "during_read",  # inside a Spark task of stage 1
    "after_state_files",  # inside stage 2, state file written, sink output not staged
    "after_sink_staging",  # all instances done, manifest not committed
    "after_commit",  # manifest committed, nothing published
    "during_publish",  # first sink published, or a Kafka transaction half sent
)


#: Where a driver can stop itself (SIGSTOP) when ``MICROBATCH_PAUSE_AT`` names the point:
#: the kill-and-race tests make a stalled attempt (a zombie) this way, resume it with
#: SIGCONT and check that it can overwrite nothing — or SIGKILL it there, a crash inside
#: a step that has no ``crash_at`` of its own.
PAUSE_POINTS = (
    "before_plan",
    "after_plan",
    "before_commit",
    "before_publish",
    "in_kafka_transaction",  # a Kafka sink's messages sent, its transaction not committed
    "in_postgres_transaction",  # a PostgreSQL sink's rows written, its transaction open
    "in_iceberg_commit",  # an Iceberg sink's snapshot written (manifests), not committed
    "in_iceberg_overwrite",  # the same for a snapshot replacing undone batches' files
    "after_iceberg_commit",  # an Iceberg sink's snapshot committed, batch not marked published
    "in_delta_optimize",  # `microbatch optimize` wrote its merged files, not committed them
    "after_rewind_commit",  # a rewind (replay, backfill) committed, not published
    "during_reshard",  # a reshard's state files written, its manifest not committed
    "gc_listed",  # GC listed and read the retained checkpoints, deleted nothing yet
    "during_gc",  # GC deleted old manifests, not yet the files only they referenced
)
PAUSE_ENV = "MICROBATCH_PAUSE_AT"


class InjectedCrash(MicrobatchError):
    """A deliberate crash at a named point (tests and the demo only)."""


def check_crash_point(point: str | None) -> str | None:
    if point is not None and point not in CRASH_POINTS:
        raise ValueError(f"unknown crash point {point!r}; known: {', '.join(CRASH_POINTS)}")
    return point


def crash_if(point: str | None, here: str, where: str) -> None:
    if point == here:
        raise InjectedCrash(f"{where}: injected crash at {here}")


def pause_if(here: str, where: str) -> None:
    """Stop this process (SIGSTOP) at ``here`` if ``MICROBATCH_PAUSE_AT`` names it."""
    assert here in PAUSE_POINTS, here
    if os.environ.get(PAUSE_ENV) == here:
        from microbatch.storage.local import no_lock_held

        log.warning("%s: pausing at %s (%s), pid %s", where, here, PAUSE_ENV, os.getpid())
        with no_lock_held():  # not while a heartbeat thread holds a local store's lock
            os.kill(os.getpid(), signal.SIGSTOP)
