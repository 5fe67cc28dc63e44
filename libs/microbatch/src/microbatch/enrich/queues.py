"""Emission queues: in which order completed elements leave the async operator.

One class per output mode, after Flink's ``StreamElementQueue`` designs (seed 001), plus
a per-key mode Flink lacks. All share one small interface:

- ``add(entry)``      — append an entry in input order (records and watermarks);
- ``complete(entry)`` — mark a record entry done; completing twice is a no-op (False);
- ``pop_ready()``     — remove and return the entries that may be emitted now, in order;
- ``len(queue)``      — records not yet emitted (in flight + completed-not-emitted).
  Watermarks are *not* counted: capacity bounds outstanding I/O, and a watermark needs
  none; they are bounded by how often the caller inserts them;
- ``pending()``       — every entry not yet emitted (watermarks included), in input order,
  which is what a snapshot stores;
- ``emits_at_once(key)`` — True if a record of ``key`` that completed the moment it was
  added would be emitted right away: nothing it has to wait for is pending. The operator
  then emits it without queueing it at all (its fast path for results that are ready
  without waiting).

Pure data structures: no asyncio, no threads, no locks. The operator touches them only on
its event-loop thread (the mailbox), so no entry is ever seen half-updated.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable
from typing import Any


class Entry:
    """One queued input: a record (done once its result is in) or a watermark (always done).

    ``seq`` is the input position; the operator subclasses this to carry its own state.
    """

    __slots__ = ("done", "is_watermark", "key", "segment", "seq")

    def __init__(self, seq: int, *, key: Hashable = None, is_watermark: bool = False) -> None:
        self.seq = seq
        self.key = key
        self.is_watermark = is_watermark
        self.done = is_watermark
        self.segment: Any = None

    def __repr__(self) -> str:
        kind = "watermark" if self.is_watermark else "record"
        return f"<{kind} #{self.seq} key={self.key!r} done={self.done}>"


class OrderedQueue:
    """Emits in input order: an entry leaves only when it and everything before it is done.

    Watermarks keep their position like records, so the stream after the operator is the
    input stream with each record replaced by its results.
    """

    def __init__(self) -> None:
        self._entries: deque[Entry] = deque()
        self._records = 0

    def add(self, entry: Entry) -> None:
        """Append ``entry`` (input order)."""
        self._entries.append(entry)
        if not entry.is_watermark:
            self._records += 1

    def complete(self, entry: Entry) -> bool:
        """Mark ``entry`` done; False if it already was (the first completion wins)."""
        if entry.done:
            return False
        entry.done = True
        return True

    def pop_ready(self) -> list[Entry]:
        """Remove and return the done prefix of the queue."""
        out: list[Entry] = []
        entries = self._entries
        while entries and entries[0].done:
            entry = entries.popleft()
            if not entry.is_watermark:
                self._records -= 1
            out.append(entry)
        return out

    def pending(self) -> list[Entry]:
        """Every entry not yet emitted, in input order."""
        return list(self._entries)

    def emits_at_once(self, key: Hashable = None) -> bool:
        """Only with nothing queued: every earlier entry must leave first."""
        return not self._entries

    def __len__(self) -> int:
        return self._records


class _Segment:
    """Records between two watermarks, or one watermark alone; emitted as a unit."""

    __slots__ = ("lanes", "waiting", "watermark")

    def __init__(self, watermark: Entry | None = None) -> None:
        self.watermark = watermark  # None for a record segment or once emitted
        self.waiting: dict[int, Entry] = {}  # records not emitted yet, by seq, input order
        self.lanes: dict[Hashable, deque[Entry]] = {}  # per-key queue only


class _SegmentedQueue:
    """Watermark segments shared by the unordered and per-key queues.

    Only the head segment's records may be emitted. A watermark segment becomes ready as
    soon as it is the head, i.e. once every record before it was emitted; records that
    completed in a later segment wait there until their segment becomes the head.
    """

    def __init__(self) -> None:
        self._segments: deque[_Segment] = deque([_Segment()])
        self._records = 0
        self._ready: list[Entry] = []  # emittable now, in emission order

    def add(self, entry: Entry) -> None:
        """Append ``entry``: a record joins the last segment, a watermark starts a new one."""
        if entry.is_watermark:
            segment = _Segment(watermark=entry)
            entry.segment = segment
            self._segments.append(segment)
            self._segments.append(_Segment())
            self._advance()
            return
        segment = self._segments[-1]
        entry.segment = segment
        segment.waiting[entry.seq] = entry
        self._records += 1
        self._on_added(entry)

    def complete(self, entry: Entry) -> bool:
        """Mark ``entry`` done; False if it already was (the first completion wins)."""
        if entry.done:
            return False
        entry.done = True
        if entry.segment is self._segments[0]:
            self._on_head_completed(entry)
        return True

    def pop_ready(self) -> list[Entry]:
        """Remove and return what may be emitted now, in emission order."""
        out: list[Entry] = []
        while self._ready:
            batch, self._ready = self._ready, []
            for entry in batch:
                if entry.is_watermark:
                    entry.segment.watermark = None
                else:
                    del entry.segment.waiting[entry.seq]
                    self._records -= 1
            out.extend(batch)
            self._advance()
        return out

    def pending(self) -> list[Entry]:
        """Every entry not yet emitted (watermarks included), in input order."""
        result: list[Entry] = []
        for segment in self._segments:
            if segment.watermark is not None:
                result.append(segment.watermark)
            result.extend(segment.waiting.values())
        return result

    def __len__(self) -> int:
        return self._records

    def emits_at_once(self, key: Hashable = None) -> bool:
        """While no watermark waits: a record would join the head segment and leave."""
        return len(self._segments) == 1 and not self._ready

    def _advance(self) -> None:
        """Retire emitted head segments; make the next head's emittable entries ready."""
        segments = self._segments
        while len(segments) > 1 and not segments[0].waiting and segments[0].watermark is None:
            segments.popleft()
            head = segments[0]
            if head.watermark is not None:
                self._ready.append(head.watermark)
            else:
                self._on_new_head(head)

    def _on_added(self, entry: Entry) -> None:
        """Hook: a record joined the last segment."""

    def _on_head_completed(self, entry: Entry) -> None:
        raise NotImplementedError

    def _on_new_head(self, segment: _Segment) -> None:
        raise NotImplementedError


class UnorderedQueue(_SegmentedQueue):
    """Emits records in completion order, with watermarks as hard boundaries.

    Records between two watermarks leave as soon as each is done; a watermark leaves only
    after every record before it, and no record after it overtakes it (event-time mode).
    Without watermarks this is pure completion order (processing-time mode). Records that
    completed while their segment waited behind a watermark leave in input order.
    """

    def _on_head_completed(self, entry: Entry) -> None:
        self._ready.append(entry)

    def _on_new_head(self, segment: _Segment) -> None:
        self._ready.extend(e for e in segment.waiting.values() if e.done)


class KeyOrderedQueue(_SegmentedQueue):
    """Keeps input order within each key; keys overtake each other freely.

    A record leaves once it and every earlier record *of its key* is done, so a slow key
    never holds back the others (Flink offers only all-or-nothing ordering). Watermarks
    are boundaries for all keys, as in :class:`UnorderedQueue`. Keys must be hashable.
    """

    def emits_at_once(self, key: Hashable = None) -> bool:
        """While no watermark waits and no earlier record of ``key`` is pending."""
        return super().emits_at_once(key) and key not in self._segments[0].lanes

    def _on_added(self, entry: Entry) -> None:
        lanes = entry.segment.lanes
        lane = lanes.get(entry.key)
        if lane is None:
            lanes[entry.key] = lane = deque()
        lane.append(entry)

    def _on_head_completed(self, entry: Entry) -> None:
        if entry.segment.lanes[entry.key][0] is entry:
            self._release(entry.segment, entry.key)

    def _on_new_head(self, segment: _Segment) -> None:
        for key in [k for k, lane in segment.lanes.items() if lane[0].done]:
            self._release(segment, key)

    def _release(self, segment: _Segment, key: Hashable) -> None:
        lane = segment.lanes[key]
        while lane and lane[0].done:
            self._ready.append(lane.popleft())
        if not lane:
            del segment.lanes[key]
