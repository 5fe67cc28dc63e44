"""Window join: pairs of one key whose records fall in the same tumbling or hopping window
(Flink's window join, Nexmark q8).

Each record is assigned to its windows as :mod:`microbatch.windows` assigns them
(half-open ``[start, start + size)``, aligned to the epoch). Both sides' records wait per
window (map states ``left`` and ``right``, window start → records in arrival order) and
a timer at the window's end fires when the watermark reaches it — no record still to come
falls in the window then. The timer emits every (left, right) pair of the window, left
records in arrival order, each with every right record in arrival order, then drops the
window. An inner join: a window with records on one side only emits nothing.

Output: ``select(left, right)`` (default :func:`~microbatch.joins.select.merge`); when it
is a dict, ``window_start`` and ``window_end`` (epoch ms) are set on it.

A window that ends at or before the batch's own watermark closes in that batch: its
records go from ``process`` to the timer in memory (:mod:`~microbatch.joins.closing`), not
through state — same pairs, same order, a state encode and decode per record less. So
``select`` may get one record object in several calls: it must not change its arguments.
Such a window with records on one side only (this batch's and earlier ones' together) can
never pair: it is dropped in ``process`` — no timer, no state, nothing held. In a join
where most keys are on one side in a window (Nexmark q8: most people sell nothing in
their window), that is most of the windows.

**Late records.** A record is assigned only to its windows that were still open when its
batch started (``end > watermark``); a record whose every window had closed is a dead
letter ``late_join``. With no record behind the watermark, the output does not depend on
how the records were split into batches.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from typing import Any

from microbatch.errors import ConfigError
from microbatch.joins.base import LATE, SIDES, JoinFunction
from microbatch.joins.base import watermark_before as _watermark_before
from microbatch.joins.closing import ClosingWindows
from microbatch.joins.select import Select, check_select
from microbatch.joins.times import EventTimeOf, TimeSpec
from microbatch.runtime.process import ProcessContext
from microbatch.state.handles import MapState
from microbatch.windows.api import WindowBuilder
from microbatch.windows.spec import Duration, Hopping, Tumbling


def window_starts(t: int, spec: Tumbling | Hopping) -> list[int]:
    """Starts of the windows holding time ``t``, ascending (as ``windows.assign``)."""
    if isinstance(spec, Tumbling):
        return [t - t % spec.size_ms]
    latest = t - t % spec.every_ms
    hops = -(-spec.size_ms // spec.every_ms)
    starts = (latest - k * spec.every_ms for k in range(hops))
    return sorted(s for s in starts if s > t - spec.size_ms)


def _spec(op: str, window: Any) -> Tumbling | Hopping:
    if isinstance(window, WindowBuilder):
        window = window.spec
    if isinstance(window, Tumbling | Hopping):
        return window
    if isinstance(window, str | int | dt.timedelta) and not isinstance(window, bool):
        return Tumbling(window)  # a size: tumbling windows
    raise ConfigError(
        f"{op} window must be a tumbling size ('5m'), Tumbling(size) or Hopping(size, every) "
        f"(windows.tumbling / windows.hopping): {window!r}"
    )


class WindowJoin(JoinFunction):
    """Pairs of one key in the same window: ``window`` is a size (tumbling),
    ``Tumbling(size)``, ``Hopping(size, every)`` or ``windows.tumbling(...)`` /
    ``windows.hopping(...)``; ``left_time`` / ``right_time``: each side's event-time field
    or a function of the record."""

    def __init__(
        self,
        left_time: TimeSpec,
        right_time: TimeSpec,
        window: Tumbling | Hopping | WindowBuilder | Duration,
        select: Select | None = None,
    ) -> None:
        op = self.name
        self.left_time = EventTimeOf(op, "left_time", left_time)
        self.right_time = EventTimeOf(op, "right_time", right_time)
        self.window = _spec(op, window)
        self.select = check_select(op, select)
        self._closing = ClosingWindows()

    def __repr__(self) -> str:
        return f"WindowJoin({self.window})"

    def process(self, key: Any, records: Sequence[Any], ctx: ProcessContext) -> None:
        before = _watermark_before(self.name, ctx)
        size = self.window.size_ms
        lefts, rights = self.split(records)
        added = (self._assign(ctx, 0, lefts, before), self._assign(ctx, 1, rights, before))
        states = (ctx.map(SIDES[0]), ctx.map(SIDES[1]))
        # Windows that end by the batch's watermark close in this same batch, after every
        # process call: their records go straight to the timer (:mod:`.closing`).
        held = self._closing.of_batch(ctx) if ctx.watermark is not None else None
        closes_by = ctx.watermark
        closing: dict[tuple[Any, ...], list[Any]] = {}
        taken = 0  # records in ``closing``
        key_bytes = ctx.key_state.key_bytes
        # A window with records in state has its timer (both are set together and dropped
        # together): only the windows of the key's timers can hold earlier records.
        waiting = {t - size for t in ctx.timers()}
        for s in sorted(added[0].keys() | added[1].keys()):
            end = s + size
            closes = closes_by is not None and end <= closes_by
            # The window's records of earlier batches (of a side this call adds to, or of
            # both sides when it closes now: then they decide whether it can pair at all).
            earlier = [
                state.get(s, []) if s in waiting and (closes or s in added[side]) else []
                for side, state in enumerate(states)
            ]
            if closes and not all(earlier[side] or s in added[side] for side in (0, 1)):
                self._drop(ctx, states, earlier, s)  # nothing to pair, nor can anything come
                continue
            for side, state in enumerate(states):
                if s not in added[side]:
                    continue
                window = earlier[side] + added[side][s]
                if closes and held is not None and held.room(taken + len(window)):
                    closing[key_bytes, side, s] = window
                    taken += len(window)
                else:
                    state.put(s, window)
            ctx.register_timer(end)
        if held is not None:  # last: a call that raised holds nothing
            held.add(closing, taken)

    def _assign(
        self, ctx: ProcessContext, side: int, records: list[Any], before: int | None
    ) -> dict[int, list[Any]]:
        """Window start → the side's records of this call in it, in time order; a record
        whose every window had closed by ``before`` is a dead letter."""
        time_of: EventTimeOf = self.left_time if side == 0 else self.right_time
        size = self.window.size_ms
        added: dict[int, list[Any]] = {}
        for t, _, record in self.timed(ctx, side, records, time_of):
            starts = window_starts(t, self.window)
            open_ = [s for s in starts if before is None or s + size > before]
            if not open_:
                ctx.dead_letter(
                    LATE,
                    f"{self.name}: {SIDES[side]} record at {t} falls only in windows "
                    f"that had closed (ends <= the watermark {before}): "
                    f"{', '.join(f'[{s}, {s + size})' for s in starts)}",
                    record,
                )
            for s in open_:
                added.setdefault(s, []).append(record)
        return added

    def _drop(
        self,
        ctx: ProcessContext,
        states: tuple[MapState, MapState],
        earlier: list[list[Any]],
        s: int,
    ) -> None:
        """Forget window ``s``, which closes in this batch with records on one side only:
        an inner join emits nothing for it. Records of earlier batches leave state with
        the window's timer; the call's own never enter it."""
        if earlier[0] or earlier[1]:
            for side, state in enumerate(states):
                if earlier[side]:
                    state.remove(s)
            ctx.delete_timer(s + self.window.size_ms)

    def on_timer(self, key: Any, timestamp_ms: int, ctx: ProcessContext) -> None:
        """The window ending at ``timestamp_ms`` closed: emit its pairs, forget it."""
        if ctx.time_domain != "event_time":
            return
        start = timestamp_ms - self.window.size_ms
        left, right = ctx.map(SIDES[0]), ctx.map(SIDES[1])
        lefts = self._closing.pop(ctx, 0, start)
        if lefts is None:
            lefts = left.get(start, [])
        rights = self._closing.pop(ctx, 1, start)
        if rights is None:
            rights = right.get(start, [])
        for lrec in lefts:
            for rrec in rights:
                out = self.select(lrec, rrec)
                if isinstance(out, dict):
                    out = {**out, "window_start": start, "window_end": timestamp_ms}
                ctx.emit(out)
        left.remove(start)
        right.remove(start)
