"""Running the async operator from synchronous code (a Spark task, a script, a test).

:func:`run_batch` owns a private event loop for one batch: it restores the previous
batch's pending inputs, feeds new ones under back-pressure, and stops at the deadline.
Whatever is not emitted by then — in flight, completed but held back by ordering, or
never started — comes back as ``pending``, in input order, for the next batch. Nothing
is lost and nothing is emitted twice: results arriving after the deadline are dropped.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from microbatch.enrich.elements import DeadLetter, Element, Output, PendingElement, Watermark
from microbatch.enrich.operator import AsyncOperator

log = logging.getLogger(__name__)


def new_event_loop() -> asyncio.AbstractEventLoop:
    """A new event loop: uvloop's when it is installed (faster I/O), else asyncio's."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


@dataclass
class BatchOutcome:
    """What one batch produced.

    ``outputs`` holds results and watermarks in emission order; ``pending`` the inputs
    to re-issue first next batch (pass it to ``run_batch(pending=...)``).
    """

    outputs: list[Output | Watermark] = field(default_factory=list)
    dead_letters: list[DeadLetter] = field(default_factory=list)
    pending: list[PendingElement] = field(default_factory=list)
    metrics: dict[str, Any] = field(default_factory=dict)


def run_batch(
    operator_factory: Callable[[], AsyncOperator],
    elements: Iterable[Element | Watermark],
    *,
    pending: Iterable[PendingElement] = (),
    deadline_s: float | None = None,
) -> BatchOutcome:
    """Enrich ``elements`` (after re-issuing ``pending``) until done or ``deadline_s``.

    ``deadline_s`` is an absolute wall-clock time (``time.time()`` seconds), so every
    task of a batch can share the driver's deadline. ``operator_factory`` runs inside the
    batch's event loop (it may create loop-bound clients). Raises
    :class:`~microbatch.errors.EnrichmentError` when the operator fails
    (``on_failure="fail"``).
    """
    loop = new_event_loop()
    try:
        return loop.run_until_complete(_run(operator_factory, elements, list(pending), deadline_s))
    finally:
        _shutdown(loop)


async def _run(
    factory: Callable[[], AsyncOperator],
    elements: Iterable[Element | Watermark],
    restored: list[PendingElement],
    deadline: float | None,
) -> BatchOutcome:
    inputs = iter(elements)
    if deadline is not None and time.time() >= deadline:
        # Past the deadline before starting: call nothing, hand everything on.
        return BatchOutcome(pending=restored + [PendingElement.of(e) for e in inputs])
    op = factory()
    try:
        op.restore(restored)
        op.feed(inputs)
        snapshot = [] if await op.finish(deadline) else op.snapshot()
        unstarted = list(op.detach_input())
        emitted = op.take_ready()
    finally:
        await op.aclose()
    outcome = BatchOutcome(
        pending=snapshot + [PendingElement.of(e) for e in unstarted],
        metrics=op.metrics.as_dict(),
    )
    for out in emitted:
        (outcome.dead_letters if isinstance(out, DeadLetter) else outcome.outputs).append(out)
    if outcome.pending:
        log.info(
            "enrichment batch stopped at its deadline: %d emitted, %d pending (%d never started)",
            len(emitted),
            len(outcome.pending),
            len(unstarted),
        )
    return outcome


def _shutdown(loop: asyncio.AbstractEventLoop, grace_s: float = 0.1) -> None:
    """Cancel what is left (e.g. client tasks), give it ``grace_s`` to unwind, close."""
    try:
        tasks = [t for t in asyncio.all_tasks(loop) if not t.done()]
        for task in tasks:
            task.cancel()
        if tasks:
            loop.run_until_complete(asyncio.wait(tasks, timeout=grace_s))
        loop.run_until_complete(loop.shutdown_asyncgens())
    finally:
        loop.close()
