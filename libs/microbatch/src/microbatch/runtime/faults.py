"""Named crash points of the commit protocol, for crash tests and the demo.

A run given ``crash_at=<point>`` raises :class:`InjectedCrash` there — nothing is cleaned
up, exactly as if the process had died — and a rerun must then produce the same outputs
and state as a run without the crash.
"""

from __future__ import annotations

from microbatch.errors import MicrobatchError

CRASH_POINTS = (
    "after_plan",  # the plan is stored, nothing read
    "during_read",  # inside a Spark task of stage 1
    "after_state_files",  # inside stage 2, state file written, sink output not staged
    "after_sink_staging",  # all instances done, manifest not committed
    "after_commit",  # manifest committed, nothing published
    "during_publish",  # first sink published, or a Kafka transaction half sent
)


class InjectedCrash(MicrobatchError):
    """A deliberate crash at a named point (tests and the demo only)."""


def check_crash_point(point: str | None) -> str | None:
    if point is not None and point not in CRASH_POINTS:
        raise ValueError(f"unknown crash point {point!r}; known: {', '.join(CRASH_POINTS)}")
    return point


def crash_if(point: str | None, here: str, where: str) -> None:
    if point == here:
        raise InjectedCrash(f"{where}: injected crash at {here}")
