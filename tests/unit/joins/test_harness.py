"""microbatch.testing.ProcessHarness runs a process function as stage 2 does: keys in
key-byte order, then due timers in timestamp order; state through a checkpoint's rows."""

from __future__ import annotations

import pytest

from microbatch.errors import StateError
from microbatch.keygroups import encode_key
from microbatch.runtime.process import KeyedProcessFunction, Sided
from microbatch.state.codec import CodecError
from microbatch.testing import DeadLetter, ProcessHarness, sided


class CountClicks(KeyedProcessFunction):
    def process(self, key, records, ctx):
        count = ctx.value("count")
        count.set(count.get(0) + len(records))
        ctx.emit({"user": key, "clicks": count.get()})


class Recorder(KeyedProcessFunction):
    """Logs every call; a record ``{"timer": t}`` registers an event-time timer at t,
    ``{"ptimer": t}`` a processing-time one; timers at odd times register t + 1."""

    def __init__(self):
        self.calls = []

    def process(self, key, records, ctx):
        self.calls.append(("process", key, list(records), ctx.watermark_before, ctx.watermark))
        for r in records:
            if "timer" in r:
                ctx.register_timer(r["timer"])
            if "ptimer" in r:
                ctx.register_processing_timer(r["ptimer"])
            if "dead" in r:
                ctx.dead_letter("bad", "it was bad", r)
            if "to" in r:
                ctx.emit(r, to=r["to"])

    def on_timer(self, key, timestamp_ms, ctx):
        self.calls.append((ctx.time_domain, key, timestamp_ms))
        ctx.emit((key, timestamp_ms))
        if timestamp_ms % 2:
            ctx.register_timer(timestamp_ms + 1)


def test_the_docstring_example_counts_clicks_across_batches():
    harness = ProcessHarness(CountClicks())
    result = harness.batch([("u1", {"page": "a"}), ("u1", {"page": "b"})])
    assert result.emitted == ({"user": "u1", "clicks": 2},)
    assert harness.batch({"u1": [{"page": "c"}]}).emitted == ({"user": "u1", "clicks": 3},)
    assert harness.state("u1") == {"count": 3}


def test_keys_come_in_key_byte_order_with_their_records_in_the_order_given():
    fn = Recorder()
    ProcessHarness(fn).batch([("b", {"n": 1}), ("a", {"n": 2}), (10, {"n": 3}), ("b", {"n": 4})])
    keys = [c[1] for c in fn.calls]
    assert keys == sorted(keys, key=encode_key) == [10, "a", "b"]
    assert fn.calls[2][2] == [{"n": 1}, {"n": 4}]


def test_due_timers_fire_after_every_process_call_in_timestamp_order():
    fn = Recorder()
    harness = ProcessHarness(fn, max_parallelism=8)
    result = harness.batch(
        [("a", {"timer": 30}), ("b", {"timer": 5}), ("b", {"timer": 500})], watermark=100
    )
    assert [c[0] for c in fn.calls] == ["process", "process"] + ["event_time"] * 3
    # 6 was registered by the timer at 5 and is due: it fires before 30
    assert result.emitted == (("b", 5), ("b", 6), ("a", 30))
    assert result.timers_fired == 3
    assert harness.state("b") == {"timers": [500]}
    assert harness.batch([], watermark=500).emitted == (("b", 500),)


def test_timers_registered_in_on_timer_that_are_due_fire_in_the_same_batch():
    harness = ProcessHarness(Recorder())
    out = harness.batch([("a", {"timer": 7})], watermark=8)
    assert out.emitted == (("a", 7), ("a", 8))


def test_processing_time_timers_fire_by_the_batch_processing_time():
    fn = Recorder()
    harness = ProcessHarness(fn)
    harness.batch([("a", {"ptimer": 1_000})], processing_time_ms=500)
    assert harness.batch([], processing_time_ms=999).emitted == ()
    assert harness.batch([], processing_time_ms=1_000).emitted == (("a", 1_000),)
    assert fn.calls[-1] == ("processing_time", "a", 1_000)


def test_the_watermark_never_goes_back_and_none_keeps_it():
    fn = Recorder()
    harness = ProcessHarness(fn)
    harness.batch([("a", {})])
    harness.batch([("a", {})], watermark=100)
    harness.batch([("a", {})], watermark=50)
    harness.batch([("a", {})])
    assert [c[3:] for c in fn.calls] == [(None, None), (None, 100), (100, 100), (100, 100)]
    assert harness.watermark == 100


def test_dead_letters_and_side_outputs_are_collected():
    out = ProcessHarness(Recorder()).batch(
        [("a", {"dead": 1}), ("a", {"to": "audit"}), ("b", {"to": "audit"})]
    )
    assert out.dead_letters == (DeadLetter("bad", "it was bad", {"dead": 1}, "a"),)
    assert out.side_outputs == {"audit": ({"to": "audit"}, {"to": "audit"})}
    assert out.emitted == ()


class Keeps(KeyedProcessFunction):
    def __init__(self, value, ttl=None):
        self.value, self.ttl = value, ttl

    def process(self, key, records, ctx):
        if records:
            ctx.value("v", ttl=self.ttl).set(self.value)
        ctx.emit(ctx.value("v", ttl=self.ttl).get())


def test_state_goes_through_the_checkpoint_row_form():
    harness = ProcessHarness(Keeps((1, [2, "x"])))
    harness.batch([("k", {})])
    assert harness.state("k") == {"v": (1, [2, "x"])}
    with pytest.raises(CodecError, match="set"):
        ProcessHarness(Keeps({1, 2})).batch([("k", {})])


def test_ttl_runs_on_the_batch_processing_time():
    harness = ProcessHarness(Keeps("v", ttl=10))
    harness.batch([("k", {})], processing_time_ms=0)
    assert harness.state("k") == {"v": "v"}
    harness.batch([], processing_time_ms=9_999)
    assert harness.state("k") == {"v": "v"}
    harness.batch([], processing_time_ms=10_000)
    assert harness.state("k") == {} and harness.keys_with_state() == []


def test_rescaling_moves_state_by_key_group():
    harness = ProcessHarness(CountClicks(), max_parallelism=8, parallelism=2)
    keys = [f"u{i}" for i in range(20)]
    harness.batch([(k, {}) for k in keys])
    for p in (3, 1, 8):
        harness.rescale(p)
        out = harness.batch([(k, {}) for k in keys])
        assert sorted(r["user"] for r in out.emitted) == sorted(keys)
        assert {r["clicks"] for r in out.emitted} == {2 + (3, 1, 8).index(p)}
    with pytest.raises(StateError):
        harness.rescale(9)


def test_restore_rewinds_to_a_checkpoint():
    harness = ProcessHarness(CountClicks())
    harness.batch([("u", {})], watermark=5)
    checkpoint = harness.checkpoint()
    first = harness.batch([("u", {})], watermark=9)
    harness.restore(checkpoint)
    assert harness.watermark == 5
    assert harness.batch([("u", {})], watermark=9) == first


def test_sided_tags_each_input_in_order():
    assert sided([("k", 1), ("j", 2)], [("k", 3)]) == [
        ("k", Sided(0, 1)),
        ("j", Sided(0, 2)),
        ("k", Sided(1, 3)),
    ]


def test_keys_the_state_layer_refuses_are_refused():
    with pytest.raises(StateError, match="bool"):
        ProcessHarness(CountClicks()).batch([(True, {})])


class Fails(KeyedProcessFunction):
    def process(self, key, records, ctx):
        ctx.value("n").set(len(records))
        if key == "boom":
            raise RuntimeError("boom")


def test_a_batch_that_raises_leaves_the_last_checkpoint():
    harness = ProcessHarness(Fails())
    harness.batch([("a", {})], watermark=1, processing_time_ms=10)
    with pytest.raises(RuntimeError):
        harness.batch([("a", {}), ("a", {}), ("boom", {})], watermark=2, processing_time_ms=20)
    assert (harness.watermark, harness.processing_time_ms) == (1, 10)
    assert harness.state("a") == {"n": 1} and harness.state("boom") == {}
