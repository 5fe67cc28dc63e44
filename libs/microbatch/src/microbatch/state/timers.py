"""Event-time timers of one operator instance, fired in timestamp order.

A timer is ``(timestamp, key)``: registering the same pair twice keeps one timer;
deleting removes it. When the watermark advances to ``W``, every timer with
``timestamp <= W`` fires exactly once, ordered by timestamp, then key-group, then key
bytes — a deterministic order, so a replayed batch fires the same timers in the same
order. Timers live in their key's key-group and are checkpointed (and rescaled) with it.

The live set per key-group is the truth; a heap orders them, with deleted entries
skipped lazily when they surface.
"""

from __future__ import annotations

import dataclasses
import heapq


@dataclasses.dataclass(frozen=True, order=True)
class Timer:
    """A timer that is due; ``key_bytes`` is the canonical key (see ``keygroups``)."""

    timestamp: int
    key_group: int
    key_bytes: bytes


#: A key without timers (shared: snapshots are never changed in place).
NO_STAMPS: frozenset[int] = frozenset()


class TimerQueue:
    """Per key-group timer sets plus one heap for firing order."""

    def __init__(self) -> None:
        self._live: dict[int, set[tuple[int, bytes]]] = {}
        self._heap: list[tuple[int, int, bytes]] = []
        #: (key-group, key) → its timestamps: a key's timers without scanning its group.
        self._by_key: dict[tuple[int, bytes], set[int]] = {}

    def register(self, key_group: int, key_bytes: bytes, timestamp: int) -> bool:
        """Add a timer; False if it already existed (nothing changed)."""
        live = self._live.setdefault(key_group, set())
        if (timestamp, key_bytes) in live:
            return False
        live.add((timestamp, key_bytes))
        self._by_key.setdefault((key_group, key_bytes), set()).add(timestamp)
        heapq.heappush(self._heap, (timestamp, key_group, key_bytes))
        return True

    def delete(self, key_group: int, key_bytes: bytes, timestamp: int) -> bool:
        """Remove a timer; False if there was none."""
        live = self._live.get(key_group)
        if not live or (timestamp, key_bytes) not in live:
            return False
        live.discard((timestamp, key_bytes))
        self._forget(key_group, key_bytes, timestamp)
        return True

    def _forget(self, key_group: int, key_bytes: bytes, timestamp: int) -> None:
        stamps = self._by_key.get((key_group, key_bytes))
        if stamps is not None:
            stamps.discard(timestamp)
            if not stamps:
                del self._by_key[key_group, key_bytes]

    def keys(self) -> set[bytes]:
        """The keys (their bytes) with a live timer."""
        return {key_bytes for _, key_bytes in self._by_key}

    def of_key(self, key_group: int, key_bytes: bytes) -> list[int]:
        return sorted(self._by_key.get((key_group, key_bytes), ()))

    def stamps(self, key_group: int, key_bytes: bytes) -> frozenset[int]:
        """The key's timestamps as a snapshot, unsorted: what a checkpoint compares
        before and after a batch, per key, most often with no timers at all."""
        live = self._by_key.get((key_group, key_bytes))
        return frozenset(live) if live else NO_STAMPS

    def of_group(self, key_group: int) -> list[tuple[int, bytes]]:
        return sorted(self._live.get(key_group, ()))

    def drop_group(self, key_group: int) -> None:
        for timestamp, key_bytes in self._live.pop(key_group, ()):
            self._forget(key_group, key_bytes, timestamp)

    def pop_due(self, watermark: int) -> Timer | None:
        """The next live timer with ``timestamp <= watermark``, removed; else None."""
        while self._heap and self._heap[0][0] <= watermark:
            timestamp, key_group, key_bytes = heapq.heappop(self._heap)
            live = self._live.get(key_group)
            if live and (timestamp, key_bytes) in live:
                live.discard((timestamp, key_bytes))
                self._forget(key_group, key_bytes, timestamp)
                return Timer(timestamp, key_group, key_bytes)
        return None

    def __len__(self) -> int:
        return sum(len(s) for s in self._live.values())
