"""Records of windows that open and close in the same batch, handed from ``process`` to
``on_timer`` in memory instead of through state.

A window whose end is at or before the batch's watermark (``ctx.watermark``) is certain to
close in this batch: its timer fires after every ``process`` call of the instance, and no
other ``process`` call of the key comes in between. Writing its records into map state
only to read them back a moment later costs a state encode and decode per record — most
of a window join's time when a batch spans many windows (Nexmark q8). The records wait
here instead, as the timer would have read them (the state's records, then the call's).

The held records belong to one batch's state on one operator instance: they are kept per
state backend (``ctx.key_state.backend``, a new object for every batch and every rerun)
and dropped with it, so an aborted attempt leaves nothing a rerun could see. State itself
ends as before: the timer removes the window, whether its records waited here or there.

Records held as Python objects take several times the memory of their encoded state, and
every one is held until the timers run: past :data:`MOST_HELD` per batch and instance, the
remaining windows go through state as usual.
"""

from __future__ import annotations

import weakref
from typing import Any

from microbatch.runtime.process import ProcessContext

#: Records held per batch and operator instance at most (a record in several windows
#: counts once per window); the windows beyond wait in state.
MOST_HELD = 250_000


class Held:
    """One batch's held records on one instance: ``(key bytes, *where)`` → what is held
    (a window join's ``where`` is (side, window start)), and how many records that is."""

    def __init__(self) -> None:
        self.entries: dict[tuple[Any, ...], Any] = {}
        self.records = 0

    def room(self, records: int) -> bool:
        """Whether ``records`` more may be held."""
        return self.records + records <= MOST_HELD

    def add(self, entries: dict[tuple[Any, ...], Any], records: int) -> None:
        self.entries.update(entries)
        self.records += records


class ClosingWindows:
    """What :class:`~microbatch.joins.WindowJoin` holds between ``process`` and
    ``on_timer`` for the windows that close in the current batch."""

    def __init__(self) -> None:
        self._by_backend: weakref.WeakKeyDictionary[Any, Held] = weakref.WeakKeyDictionary()

    def __reduce__(self) -> tuple[type[ClosingWindows], tuple[()]]:
        return ClosingWindows, ()  # shipped to workers (and copied) empty

    def of_batch(self, ctx: ProcessContext) -> Held | None:
        """The held records of ``ctx``'s batch and instance; None when its state backend
        cannot be told apart (no weak reference to it): then nothing may be held."""
        backend = ctx.key_state.backend
        try:
            held = self._by_backend.get(backend)
            if held is None:
                held = self._by_backend[backend] = Held()
        except TypeError:
            return None
        return held

    def pop(self, ctx: ProcessContext, *where: Any) -> Any:
        """What ``process`` held for the key of ``ctx`` at ``where``, no longer held; None
        when nothing is (it is in state, if anywhere)."""
        held = self._by_backend.get(ctx.key_state.backend) if self._by_backend else None
        if held is None or not held.entries:
            return None
        return held.entries.pop((ctx.key_state.key_bytes, *where), None)
