"""Temporal (as-of) join: each left record joined with the right side's version valid at
its event time (Flink's event-time temporal join, Quix's ``join_asof``).

The right side (side 1) is a versioned table: each right record is the key's version
from its event time on, until the next version. A left record at ``t`` joins the version
with the greatest version time ``<= t``; two versions with the same time: the later one
(later batch, then later in source order) replaces the earlier.

**Deterministic with out-of-order data.** A left record is held (map state ``pending``)
until the watermark passes ``t`` — by then every version at or before ``t`` that is on
time has arrived — and is emitted by the timer at ``t + 1``, in the batch whose watermark
passes ``t``. So the output does not depend on how records were split into batches, as
long as no record came behind the watermark.

**Retention.** Versions (map state ``versions``) are kept for ``retention`` behind the
watermark: once the watermark passes ``v + retention`` for a version ``v``, every version
older than the newest one at or before ``watermark - retention`` is dropped; that one (and
so the latest version at or before the watermark) is always kept. A key's last version is
never dropped: it is the value for every later record.

**Late records** (dead letters ``late_join``): a left record more than ``retention``
behind the watermark the batch started with (its version may be gone); a right version
older than a version already in force at that horizon (no record still to come can join
it). A left record behind the watermark but within the retention is joined like any
other, in the same batch.

``how="inner"``: a left record with no version at or before its time emits nothing;
``"left"``: it is emitted with the right side ``None``.

**No deletes.** A version lasts until the next one: a right ``None`` record has no
version time, so Kafka tombstones (``KafkaSource(tombstones=True)``) cannot feed this
join — refused when the pipeline is built, unlike a :class:`~microbatch.joins.TableJoin`.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import Any

from microbatch.errors import ConfigError
from microbatch.joins.base import LATE, LEFT, RIGHT, JoinFunction, check_how
from microbatch.joins.base import watermark_before as _watermark_before
from microbatch.joins.select import Select, check_select
from microbatch.joins.times import EventTimeOf, TimeSpec
from microbatch.runtime.process import ProcessContext
from microbatch.windows.spec import Duration, duration_ms

HOWS = ("inner", "left")
VERSIONS, PENDING = "versions", "pending"


class TemporalJoin(JoinFunction):
    """Left records joined with the right version valid at their event time.

    ``left_time`` / ``right_time``: each side's event-time field or a function of the
    record (a right record's time is its version's start). ``retention``: how long
    versions are kept behind the watermark (``"1h"``, ms, timedelta; > 0) — also how far
    behind the watermark a left record may come and still be joined. ``how``:
    ``"inner"`` or ``"left"``. ``select(left, right)`` makes the output record (default
    :func:`~microbatch.joins.select.merge`).
    """

    def __init__(
        self,
        left_time: TimeSpec,
        right_time: TimeSpec,
        retention: Duration | None,
        select: Select | None = None,
        how: str = "inner",
    ) -> None:
        op = self.name
        self.left_time = EventTimeOf(op, "left_time", left_time)
        self.right_time = EventTimeOf(op, "right_time", right_time)
        if retention is None:
            raise ConfigError(
                f"{op} needs a retention (how long right versions are kept behind the "
                "watermark, e.g. '1h'); without one its state would grow without bound"
            )
        self.retention = duration_ms(f"{op} retention", retention)
        self.how = check_how(op, how, HOWS)
        self.select = check_select(op, select)

    def __repr__(self) -> str:
        return f"TemporalJoin(retention={self.retention} ms, how={self.how!r})"

    def process(self, key: Any, records: Sequence[Any], ctx: ProcessContext) -> None:
        before = _watermark_before(self.name, ctx)
        horizon = None if before is None else before - self.retention
        lefts, rights = self.split(records)
        if rights:
            versions = ctx.map(VERSIONS)
            timed = self.timed(ctx, RIGHT, rights, self.right_time)
            in_force = None  # the newest held version at or before the horizon
            if horizon is not None and timed:
                in_force = max((v for v, _ in versions.items() if v <= horizon), default=None)
            for t, _, record in timed:  # by time, then source order: the last one wins
                if in_force is not None and t < in_force:
                    ctx.dead_letter(
                        LATE,
                        f"{self.name}: right version at {t} is older than the version at "
                        f"{in_force}, in force at the watermark {before} minus the retention "
                        f"({self.retention} ms): no record still to come can join it",
                        record,
                    )
                    continue
                versions.put(t, record)
                ctx.register_timer(t + self.retention)
        if lefts:
            pending = ctx.map(PENDING)
            waiting: dict[int, list[Any]] = {}
            for t, _, record in self.timed(ctx, LEFT, lefts, self.left_time):
                if horizon is not None and t < horizon:
                    ctx.dead_letter(
                        LATE,
                        f"{self.name}: left record at {t} is behind the watermark {before} "
                        f"by more than the retention ({self.retention} ms): the version "
                        "valid then may be gone",
                        record,
                    )
                    continue
                waiting.setdefault(t, []).append(record)
            for t, new in waiting.items():
                pending.put(t, pending.get(t, []) + new)
                ctx.register_timer(t + 1)

    def on_timer(self, key: Any, timestamp_ms: int, ctx: ProcessContext) -> None:
        """Emit the left records at ``timestamp_ms - 1`` (the watermark passed them), then
        drop the versions the retention no longer needs."""
        if ctx.time_domain != "event_time":
            return
        pending, versions = ctx.map(PENDING), ctx.map(VERSIONS)
        held = versions.to_dict()
        times = sorted(held)
        t = timestamp_ms - 1
        waiting = pending.get(t)
        if waiting is not None:
            i = bisect.bisect_right(times, t)
            version = held[times[i - 1]] if i else None
            for record in waiting:
                if version is not None:
                    ctx.emit(self.select(record, version))
                elif self.how == "left":
                    ctx.emit(self.select(record, None))
            pending.remove(t)
        at_horizon = bisect.bisect_right(times, timestamp_ms - self.retention)
        for v in times[: max(at_horizon - 1, 0)]:  # all but the newest at the horizon
            versions.remove(v)
