"""The keyed state of one operator instance: in memory, grouped by key-group.

An instance owns a :class:`~microbatch.keygroups.KeyGroupRange`; all its state lives in
per-key-group tables so a checkpoint can write (and a restore can read) whole key-groups,
and so the backend knows *which* key-groups changed since the last checkpoint
(``dirty``) — the basis of format 1's incremental checkpoints — and which keys
(``dirty_keys``: a change set at key granularity, for state that lives in sorted runs,
:mod:`microbatch.state.engine`).

Layout: ``groups[kg][state_name][key_bytes]`` → for value state ``(value_bytes,
expires_ms)``, for list state a list of those, for map state ``{field_bytes: (value_bytes,
expires_ms)}``. Timers live in a :class:`~microbatch.state.timers.TimerQueue`. The
row form (:data:`ROW_COLUMNS`) is what format-1 state files store, one row per value, list
element, map entry or timer (a run's bundle holds a key's rows without the key).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from microbatch.errors import StateError
from microbatch.keygroups import (
    Key,
    KeyGroupRange,
    check_max_parallelism,
    decode_key,
    encode_key,
    key_group_of_bytes,
)
from microbatch.state.codec import decode_value
from microbatch.state.handles import KeyContext
from microbatch.state.spec import KINDS, Kind, StateSpec
from microbatch.state.timers import Timer, TimerQueue

TIMER_KIND = "timer"
#: A processing-time timer: due when a batch's recorded processing time reaches it.
PROCESSING_TIMER_KIND = "processing_timer"
#: Columns of the row form, in state-file order.
ROW_COLUMNS = ("state", "kind", "key", "field", "value", "expires_ms", "timer_ts")
Rows = dict[str, list[Any]]


def empty_rows() -> Rows:
    return {c: [] for c in ROW_COLUMNS}


class KeyedStateBackend:
    """State of the key-groups ``key_groups`` out of ``max_parallelism``.

    ``clock`` returns seconds (default ``time.time``); tests inject a fake one for TTL.
    """

    def __init__(
        self,
        max_parallelism: int,
        key_groups: KeyGroupRange,
        *,
        clock: Callable[[], float] = time.time,
    ) -> None:
        check_max_parallelism(max_parallelism)
        if not key_groups.is_empty and key_groups.end >= max_parallelism:
            raise StateError(f"key-groups {key_groups} exceed max_parallelism={max_parallelism}")
        self.max_parallelism = max_parallelism
        self.key_groups = key_groups
        self.clock = clock
        self.groups: dict[int, dict[str, dict[bytes, Any]]] = {}
        self.kinds: dict[str, Kind] = {}
        self.specs: dict[str, StateSpec] = {}
        self.timers = TimerQueue()
        self.processing_timers = TimerQueue()
        self.dirty: set[int] = set()
        self.dirty_keys: set[tuple[int, bytes]] = set()
        self._min_expiry: dict[int, int] = {}
        self.watermark: int | None = None

    # --- time and bookkeeping -------------------------------------------------------
    def now_ms(self) -> int:
        return int(self.clock() * 1000)

    def expiry_for(self, spec: StateSpec) -> int | None:
        return None if spec.ttl is None else self.now_ms() + int(spec.ttl * 1000)

    def touch(self, kg: int, key_bytes: bytes, expires: int | None) -> None:
        """Record a write to ``key_bytes`` in ``kg`` (and its earliest expiry, for pruning)."""
        self.dirty.add(kg)
        self.dirty_keys.add((kg, key_bytes))
        if expires is not None and expires < self._min_expiry.get(kg, expires + 1):
            self._min_expiry[kg] = expires

    def touch_many(self, written: Sequence[tuple[int, bytes]], expires: int | None) -> None:
        """:meth:`touch` of many (key-group, key bytes) written with one expiry."""
        self.dirty_keys.update(written)
        groups = {kg for kg, _ in written}
        self.dirty |= groups
        if expires is not None:
            for kg in groups:
                if expires < self._min_expiry.get(kg, expires + 1):
                    self._min_expiry[kg] = expires

    def declare(self, name: str, kind: Kind, ttl: float | None) -> StateSpec:
        """Declare (or re-declare) state ``name``; its kind can never change."""
        known = self.kinds.get(name)
        if known is not None and known != kind:
            raise StateError(f"state {name!r} is {known} state; it cannot be used as {kind} state")
        spec = self.specs.get(name)
        if spec is None or spec.ttl != ttl or spec.kind != kind:
            spec = StateSpec(name, kind, ttl)
            self.specs[name] = spec
            self.kinds[name] = kind
        return spec

    def table(self, kg: int, name: str, create: bool = False) -> dict[bytes, Any] | None:
        group = self.groups.get(kg)
        if group is None:
            if not create:
                return None
            group = self.groups[kg] = {}
        found = group.get(name)
        if found is None and create:
            found = group[name] = {}
        return found

    # --- user access ------------------------------------------------------------------
    def for_key(self, key: Key) -> KeyContext:
        """A context for ``key``; refused if the key is not in this instance's key-groups."""
        key_bytes = encode_key(key)
        return self.for_placed(key, key_bytes, key_group_of_bytes(key_bytes, self.max_parallelism))

    def for_placed(self, key: Key, key_bytes: bytes, kg: int) -> KeyContext:
        """:meth:`for_key` for a key whose canonical bytes and key-group the caller has
        (a batch's records carry both): not encoded and hashed again per call."""
        if kg not in self.key_groups:
            raise StateError(
                f"key {key!r} is in key-group {kg}, outside this instance's key-groups "
                f"{self.key_groups}: route records by key-group before keyed processing"
            )
        return KeyContext(self, key, key_bytes, kg)

    def register_timer(self, kg: int, key_bytes: bytes, timestamp: int) -> None:
        self._register(self.timers, kg, key_bytes, timestamp)

    def delete_timer(self, kg: int, key_bytes: bytes, timestamp: int) -> None:
        self._delete(self.timers, kg, key_bytes, timestamp)

    def register_processing_timer(self, kg: int, key_bytes: bytes, timestamp: int) -> None:
        self._register(self.processing_timers, kg, key_bytes, timestamp)

    def delete_processing_timer(self, kg: int, key_bytes: bytes, timestamp: int) -> None:
        self._delete(self.processing_timers, kg, key_bytes, timestamp)

    def _register(self, queue: TimerQueue, kg: int, key_bytes: bytes, timestamp: int) -> None:
        if not isinstance(timestamp, int) or isinstance(timestamp, bool):
            raise StateError(f"timer timestamp must be an int (ms): {timestamp!r}")
        if queue.register(kg, key_bytes, timestamp):
            self.dirty.add(kg)
            self.dirty_keys.add((kg, key_bytes))

    def _delete(self, queue: TimerQueue, kg: int, key_bytes: bytes, timestamp: int) -> None:
        if queue.delete(kg, key_bytes, timestamp):
            self.dirty.add(kg)
            self.dirty_keys.add((kg, key_bytes))

    def advance_processing_time(
        self, now_ms: int, on_timer: Callable[[KeyContext, int], None] | None = None
    ) -> list[Timer]:
        """Fire every processing-time timer with ``timestamp <= now_ms`` (the batch's
        recorded processing time, so a rerun fires the same), in order; return them."""
        return self._fire(self.processing_timers, now_ms, on_timer)

    def _fire(
        self, queue: TimerQueue, until: int, on_timer: Callable[[KeyContext, int], None] | None
    ) -> list[Timer]:
        """Fire ``queue``'s timers due by ``until`` in order, each key marked changed."""
        fired = []
        while (timer := queue.pop_due(until)) is not None:
            self.dirty.add(timer.key_group)
            self.dirty_keys.add((timer.key_group, timer.key_bytes))
            fired.append(timer)
            if on_timer is not None:
                key = decode_key(timer.key_bytes)
                on_timer(KeyContext(self, key, timer.key_bytes, timer.key_group), timer.timestamp)
        return fired

    def advance_watermark(
        self, watermark: int, on_timer: Callable[[KeyContext, int], None] | None = None
    ) -> list[Timer]:
        """Fire every timer with ``timestamp <= watermark`` in order; return them.

        ``on_timer(ctx, timestamp)`` may read/write state and register new timers; a new
        timer that is already due fires in this same call, after the earlier ones.
        """
        if self.watermark is not None and watermark < self.watermark:
            return []  # watermarks never go back; a late one changes nothing
        self.watermark = watermark
        return self._fire(self.timers, watermark, on_timer)

    # --- checkpoint support -------------------------------------------------------------
    def prune_expired(self) -> None:
        """Drop expired entries (TTL); key-groups that lose entries become dirty."""
        now = self.now_ms()
        for kg in [kg for kg, exp in self._min_expiry.items() if exp <= now]:
            self._min_expiry.pop(kg)
            new_min = None
            for name, table in self.groups.get(kg, {}).items():
                kind = self.kinds[name]
                for key_bytes in list(table):
                    entry = table[key_bytes]
                    if kind == "value":
                        live = entry if entry[1] is None or entry[1] > now else None
                        exps = [live[1]] if live else []
                    elif kind == "list":
                        live = [e for e in entry if e[1] is None or e[1] > now]
                        exps = [e[1] for e in live]
                    else:
                        live = {f: e for f, e in entry.items() if e[1] is None or e[1] > now}
                        exps = [e[1] for e in live.values()]
                    if not live:
                        del table[key_bytes]
                        self.dirty.add(kg)
                        self.dirty_keys.add((kg, key_bytes))
                    elif live is not entry and len(live) != len(entry):
                        table[key_bytes] = live
                        self.dirty.add(kg)
                        self.dirty_keys.add((kg, key_bytes))
                    exps = [e for e in exps if e is not None]
                    if exps:
                        new_min = min(exps) if new_min is None else min(new_min, *exps)
            if new_min is not None:
                self._min_expiry[kg] = new_min

    def groups_with_state(self) -> list[int]:
        with_timers = {
            kg
            for kg in self.key_groups
            if self.timers.of_group(kg) or self.processing_timers.of_group(kg)
        }
        with_state = {kg for kg, g in self.groups.items() if any(g.values())}
        return sorted(with_state | with_timers)

    def export_rows(self, kg: int) -> Rows:
        """The row form of key-group ``kg``, in a deterministic order."""
        rows = empty_rows()

        def add(name: str, kind: str, key: bytes, field: Any, value: Any, exp: Any, ts: Any):
            for col, v in zip(ROW_COLUMNS, (name, kind, key, field, value, exp, ts), strict=True):
                rows[col].append(v)

        for name, table in sorted(self.groups.get(kg, {}).items()):
            kind = self.kinds[name]
            for key_bytes in sorted(table):
                entry = table[key_bytes]
                if kind == "value":
                    add(name, kind, key_bytes, None, entry[0], entry[1], None)
                elif kind == "list":
                    for value, exp in entry:
                        add(name, kind, key_bytes, None, value, exp, None)
                else:
                    for field in sorted(entry):
                        add(name, kind, key_bytes, field, entry[field][0], entry[field][1], None)
        for ts, key_bytes in self.timers.of_group(kg):
            add("", TIMER_KIND, key_bytes, None, None, None, ts)
        for ts, key_bytes in self.processing_timers.of_group(kg):
            add("", PROCESSING_TIMER_KIND, key_bytes, None, None, None, ts)
        return rows

    def export_key(self, kg: int, key_bytes: bytes) -> list[tuple[Any, ...]]:
        """The rows of one key (every state and timer), without the key column, in the
        order of :meth:`export_rows`; empty when the key has no state."""
        out: list[tuple[Any, ...]] = []
        for name, table in sorted(self.groups.get(kg, {}).items()):
            entry = table.get(key_bytes)
            if entry is None:
                continue
            kind = self.kinds[name]
            if kind == "value":
                out.append((name, kind, None, entry[0], entry[1], None))
            elif kind == "list":
                out += [(name, kind, None, value, exp, None) for value, exp in entry]
            else:
                out += [(name, kind, f, entry[f][0], entry[f][1], None) for f in sorted(entry)]
        out += [("", TIMER_KIND, None, None, None, ts) for ts in self.timers.of_key(kg, key_bytes)]
        out += [
            ("", PROCESSING_TIMER_KIND, None, None, None, ts)
            for ts in self.processing_timers.of_key(kg, key_bytes)
        ]
        return out

    def import_key(self, kg: int, key_bytes: bytes, rows: Sequence[tuple[Any, ...]]) -> None:
        """Load one key's rows (as :meth:`export_key` gives them) into a key with no state
        here yet: point access brings in just the keys a batch touches."""
        columns = empty_rows()
        for name, kind, field, value, exp, ts in rows:
            for col, v in zip(
                ROW_COLUMNS, (name, kind, key_bytes, field, value, exp, ts), strict=True
            ):
                columns[col].append(v)
        self._add_rows(kg, columns)

    def import_rows(self, kg: int, rows: Rows) -> None:
        """Load the row form of ``kg`` (replacing what the backend held for it)."""
        self.groups.pop(kg, None)
        self.timers.drop_group(kg)
        self.processing_timers.drop_group(kg)
        self._add_rows(kg, rows)

    def _add_rows(self, kg: int, rows: Rows) -> None:
        columns = [rows[c] for c in ROW_COLUMNS]
        for name, kind, key_bytes, field, value, exp, ts in zip(*columns, strict=True):
            if kind == TIMER_KIND:
                self.timers.register(kg, key_bytes, ts)
                continue
            if kind == PROCESSING_TIMER_KIND:
                self.processing_timers.register(kg, key_bytes, ts)
                continue
            if kind not in KINDS:
                raise StateError(f"unknown state kind {kind!r} for state {name!r} in {kg}")
            if self.kinds.setdefault(name, kind) != kind:
                raise StateError(f"state {name!r} is both {self.kinds[name]} and {kind} state")
            table = self.table(kg, name, create=True)
            if kind == "value":
                table[key_bytes] = (value, exp)
            elif kind == "list":
                table.setdefault(key_bytes, []).append((value, exp))
            else:
                table.setdefault(key_bytes, {})[field] = (value, exp)
            if exp is not None and exp < self._min_expiry.get(kg, exp + 1):
                self._min_expiry[kg] = exp

    def describe_key(self, key: Key, include_expired: bool = False) -> dict[str, Any]:
        """Every state of ``key`` as plain values (for inspection), plus ``"timers"``."""
        key_bytes = encode_key(key)
        kg = key_group_of_bytes(key_bytes, self.max_parallelism)
        now = self.now_ms()

        def alive(exp: int | None) -> bool:
            return include_expired or exp is None or exp > now

        out: dict[str, Any] = {}
        for name, table in sorted(self.groups.get(kg, {}).items()):
            entry = table.get(key_bytes)
            if entry is None:
                continue
            kind = self.kinds[name]
            if kind == "value":
                if alive(entry[1]):
                    out[name] = decode_value(entry[0])
            elif kind == "list":
                items = [decode_value(v) for v, e in entry if alive(e)]
                if items:
                    out[name] = items
            else:
                fields = {
                    decode_value(f): decode_value(v) for f, (v, e) in entry.items() if alive(e)
                }
                if fields:
                    out[name] = fields
        timers = self.timers.of_key(kg, key_bytes)
        if timers:
            out["timers"] = timers
        processing = self.processing_timers.of_key(kg, key_bytes)
        if processing:
            out["processing_timers"] = processing
        return out

    def keys(self, kgs: Iterable[int] | None = None) -> set[bytes]:
        """Canonical bytes of every key with state or timers in ``kgs`` (default: all)."""
        found: set[bytes] = set()
        for kg in self.groups_with_state() if kgs is None else kgs:
            for table in self.groups.get(kg, {}).values():
                found.update(table)
            found.update(kb for _, kb in self.timers.of_group(kg))
            found.update(kb for _, kb in self.processing_timers.of_group(kg))
        return found
