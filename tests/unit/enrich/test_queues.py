"""The emission queues: one contract over every mode, then each mode's own order."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from microbatch.enrich import Entry, KeyOrderedQueue, OrderedQueue, UnorderedQueue

ALL = [OrderedQueue, UnorderedQueue, KeyOrderedQueue]


class Feed:
    """Adds records/watermarks with increasing sequence numbers."""

    def __init__(self, queue) -> None:
        self.queue = queue
        self.seq = 0

    def record(self, key=None) -> Entry:
        entry = Entry(self.seq, key=key)
        self.seq += 1
        self.queue.add(entry)
        return entry

    def watermark(self) -> Entry:
        entry = Entry(self.seq, is_watermark=True)
        self.seq += 1
        self.queue.add(entry)
        return entry


def seqs(entries) -> list[int]:
    return [e.seq for e in entries]


@pytest.mark.parametrize("queue_type", ALL)
def test_len_counts_unemitted_records_but_not_watermarks(queue_type):
    feed = Feed(queue_type())
    a = feed.record("k")
    feed.watermark()
    feed.record("k")

    assert len(feed.queue) == 2
    feed.queue.complete(a)
    feed.queue.pop_ready()
    assert len(feed.queue) == 1


@pytest.mark.parametrize("queue_type", ALL)
def test_complete_twice_returns_false_and_emits_once(queue_type):
    feed = Feed(queue_type())
    a = feed.record()

    assert feed.queue.complete(a) is True
    assert feed.queue.complete(a) is False
    assert seqs(feed.queue.pop_ready()) == [0]
    assert feed.queue.pop_ready() == []


@pytest.mark.parametrize("queue_type", ALL)
def test_watermark_on_empty_queue_is_ready_at_once(queue_type):
    feed = Feed(queue_type())
    feed.watermark()

    assert seqs(feed.queue.pop_ready()) == [0]
    assert feed.queue.pending() == []


@pytest.mark.parametrize("queue_type", ALL)
def test_watermark_waits_for_earlier_records_and_later_records_wait_for_it(queue_type):
    feed = Feed(queue_type())
    a = feed.record("k1")
    feed.watermark()
    b = feed.record("k2")

    feed.queue.complete(b)
    assert feed.queue.pop_ready() == []
    feed.queue.complete(a)
    assert seqs(feed.queue.pop_ready()) == [0, 1, 2]


@pytest.mark.parametrize("queue_type", ALL)
def test_pending_lists_unemitted_entries_in_input_order(queue_type):
    feed = Feed(queue_type())
    a, b = feed.record("x"), feed.record("y")
    feed.watermark()
    c = feed.record("x")
    feed.queue.complete(c)
    feed.queue.complete(b)
    emitted = seqs(feed.queue.pop_ready())

    pending = seqs(feed.queue.pending())

    assert sorted(pending + emitted) == [0, 1, 2, 3]
    assert pending == sorted(pending)
    assert a.seq in pending


def test_ordered_queue_holds_everything_behind_the_head():
    feed = Feed(OrderedQueue())
    a, b, c = feed.record(), feed.record(), feed.record()

    feed.queue.complete(c)
    feed.queue.complete(b)
    assert feed.queue.pop_ready() == []
    assert len(feed.queue) == 3
    feed.queue.complete(a)
    assert seqs(feed.queue.pop_ready()) == [0, 1, 2]


def test_unordered_queue_emits_in_completion_order_within_a_segment():
    feed = Feed(UnorderedQueue())
    a, b, c = feed.record(), feed.record(), feed.record()

    feed.queue.complete(c)
    assert seqs(feed.queue.pop_ready()) == [2]
    feed.queue.complete(a)
    feed.queue.complete(b)
    assert seqs(feed.queue.pop_ready()) == [0, 1]
    assert len(feed.queue) == 0


def test_unordered_queue_releases_a_held_segment_when_the_watermark_passes():
    feed = Feed(UnorderedQueue())
    a = feed.record()
    feed.watermark()
    b, c = feed.record(), feed.record()
    feed.watermark()
    d = feed.record()
    for entry in (d, c, b):
        feed.queue.complete(entry)
    assert feed.queue.pop_ready() == []

    feed.queue.complete(a)

    assert seqs(feed.queue.pop_ready()) == [0, 1, 2, 3, 4, 5]


def test_key_ordered_queue_keeps_key_order_and_lets_other_keys_pass():
    feed = Feed(KeyOrderedQueue())
    a1, b1, a2, b2 = feed.record("a"), feed.record("b"), feed.record("a"), feed.record("b")

    feed.queue.complete(a2)
    feed.queue.complete(b1)
    assert seqs(feed.queue.pop_ready()) == [1]  # b1 passes the slow a1; a2 waits for a1
    feed.queue.complete(a1)
    assert seqs(feed.queue.pop_ready()) == [0, 2]
    feed.queue.complete(b2)
    assert seqs(feed.queue.pop_ready()) == [3]


# Property: whatever the completion order, each mode's contract holds --------------------

ops = st.lists(
    st.one_of(st.tuples(st.just("r"), st.integers(0, 3)), st.just(("w", None))),
    min_size=1,
    max_size=30,
)


@settings(max_examples=150, deadline=None)
@given(ops=ops, seed=st.integers(0, 2**32 - 1), queue_type=st.sampled_from(ALL))
def test_every_entry_is_emitted_once_in_a_valid_order(ops, seed, queue_type):
    rng = random.Random(seed)
    feed = Feed(queue_type())
    records, entries, emitted = [], [], []
    for kind, key in ops:
        entry = feed.watermark() if kind == "w" else feed.record(key)
        entries.append(entry)
        if kind == "r":
            records.append(entry)
    rng.shuffle(records)
    for entry in records:  # complete in random order, popping as we go
        feed.queue.complete(entry)
        emitted += feed.queue.pop_ready()
        assert seqs(feed.queue.pending()) == sorted(seqs(feed.queue.pending()))
    emitted += feed.queue.pop_ready()

    assert sorted(seqs(emitted)) == list(range(len(entries)))  # each exactly once
    assert len(feed.queue) == 0 and feed.queue.pending() == []
    position = {e.seq: i for i, e in enumerate(emitted)}
    watermarks = [e.seq for e in entries if e.is_watermark]
    for w in watermarks:  # nothing crosses a watermark, in any mode
        for e in entries:
            assert (position[e.seq] < position[w]) == (e.seq < w) or e.seq == w
    if queue_type is OrderedQueue:
        assert seqs(emitted) == list(range(len(entries)))
    if queue_type is KeyOrderedQueue:
        for key in range(4):
            of_key = [e.seq for e in emitted if not e.is_watermark and e.key == key]
            assert of_key == sorted(of_key)
