"""IntervalJoin equals a plain-Python reference batch by batch on out-of-order data with
late records, for every ``how``; pairs are made once; outer rows come when the watermark
rules out a partner; the output does not depend on batching, record order or rescaling."""

from __future__ import annotations

import collections
import datetime as dt
import random

import pytest

from microbatch.errors import ConfigError
from microbatch.joins import IntervalJoin
from microbatch.runtime.process import Sided
from microbatch.state.codec import CodecError
from microbatch.testing import ProcessHarness, sided
from tests.unit.joins.streams import (
    FLUSH,
    Event,
    arrival_order,
    dead,
    emitted,
    events,
    lagging_watermarks,
    pair_ids,
    run,
    safe_watermarks,
    split,
    starts,
)

HOWS = ("inner", "left", "right", "full")
PLUS_2 = dt.timezone(dt.timedelta(hours=2))
BOUNDS = [(-50, 50), (0, 100), (-100, -20), (20, 30), (0, 0)]


def reference(batches, watermarks, lower, upper, how):
    """Per batch: the pairs (and unmatched rows) emitted, and the late records.

    A record is late when its last partner time (left: t + upper, right: t - lower) is
    behind the watermark its batch starts with. A pair of accepted records is made in the
    batch of the later one, if the earlier one is still held then (its last partner time
    not behind that batch's starting watermark). An unmatched record of an outer side is
    emitted in the first batch whose watermark passes its last partner time."""
    begin = starts(watermarks)
    out = [collections.Counter() for _ in batches]
    late = [collections.Counter() for _ in batches]
    accepted = []
    for j, batch in enumerate(batches):
        for e in batch:
            last = e.t + upper if e.side == 0 else e.t - lower
            if begin[j] is not None and last < begin[j]:
                late[j]["late_join", e.id] += 1
            else:
                accepted.append((e, j, last))

    def held(x, j):
        _, b, last = x
        return b == j or begin[j] is None or last >= begin[j]

    matched = set()
    lefts = [x for x in accepted if x[0].side == 0]
    rights = [x for x in accepted if x[0].side == 1]
    for lx in lefts:
        for rx in rights:
            le, re_ = lx[0], rx[0]
            if le.key != re_.key or not lower <= re_.t - le.t <= upper:
                continue
            j = max(lx[1], rx[1])
            earlier = lx if lx[1] < rx[1] else rx
            if held(earlier, j):
                out[j][le.id, re_.id] += 1
                matched |= {le.id, re_.id}
    outer = (how in ("left", "full"), how in ("right", "full"))
    for e, b, last in accepted:
        if e.id in matched or not outer[e.side]:
            continue
        due = [j for j in range(b, len(batches)) if (watermarks[j] or -FLUSH) > last]
        if due:
            out[due[0]][(e.id, None) if e.side == 0 else (None, e.id)] += 1
    return out, late


def late_data(seed, batches=8):
    arrived = arrival_order(events(seed, 60), seed, disorder=100, late_share=0.15)
    cut = [*split(arrived, seed, batches), []]
    return cut, [*lagging_watermarks(cut[:-1], lateness=50), FLUSH]


@pytest.mark.parametrize("how", HOWS)
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_join_on_late_out_of_order_data_equals_the_reference_batch_by_batch(how, seed):
    lower, upper = BOUNDS[seed % len(BOUNDS)] if seed != 3 else (-30, 80)
    batches, watermarks = late_data(seed)
    join = IntervalJoin("ts", "ts", between=(lower, upper), how=how, select=pair_ids)
    results, harness = run(join, batches, watermarks)
    want, want_late = reference(batches, watermarks, lower, upper, how)
    assert sum(want_late, collections.Counter()), "the data should have late records"
    assert emitted(results) == want
    assert dead(results) == want_late
    assert harness.keys_with_state() == []  # the flush dropped everything


@pytest.mark.parametrize("bounds", BOUNDS)
def test_every_bound_shape_equals_the_reference(bounds):
    batches, watermarks = late_data(7, batches=12)
    join = IntervalJoin("ts", "ts", between=bounds, how="full", select=pair_ids)
    want, want_late = reference(batches, watermarks, *bounds, "full")
    results, _ = run(join, batches, watermarks)
    assert emitted(results) == want
    assert dead(results) == want_late


def nested_loop(evs, lower, upper, how):
    pairs = collections.Counter()
    matched = set()
    for le in (e for e in evs if e.side == 0):
        for re_ in (e for e in evs if e.side == 1):
            if le.key == re_.key and lower <= re_.t - le.t <= upper:
                pairs[le.id, re_.id] += 1
                matched |= {le.id, re_.id}
    for e in evs:
        if e.id not in matched and how in (("left", "full"), ("right", "full"))[e.side]:
            pairs[(e.id, None) if e.side == 0 else (None, e.id)] += 1
    return pairs


@pytest.mark.parametrize("how", ["inner", "full"])
@pytest.mark.parametrize("n_batches", [1, 2, 5, 17, 120])
def test_output_without_late_records_does_not_depend_on_batching(how, n_batches):
    evs = events(11, 60)
    arrived = arrival_order(evs, 11, disorder=300, late_share=0.0)
    batches = split(arrived, n_batches, n_batches)
    watermarks = safe_watermarks(batches)
    join = IntervalJoin("ts", "ts", between=(-40, 60), how=how, select=pair_ids)
    results, harness = run(join, batches, watermarks)
    assert all(not r.dead_letters for r in results)
    assert sum(emitted(results), collections.Counter()) == nested_loop(evs, -40, 60, how)
    assert harness.keys_with_state() == []


def test_output_does_not_depend_on_the_order_of_records_within_a_batch():
    batches, watermarks = late_data(5)
    join = IntervalJoin("ts", "ts", between=(-50, 50), how="full", select=pair_ids)
    first, _ = run(join, batches, watermarks)
    for shuffle in (1, 2):
        again, _ = run(join, batches, watermarks, shuffle=shuffle)
        assert emitted(again) == emitted(first)
        assert dead(again) == dead(first)


def test_rescaling_between_batches_changes_no_output():
    batches, watermarks = late_data(6, batches=9)
    join = IntervalJoin("ts", "ts", between=(-50, 50), how="full", select=pair_ids)
    one, _ = run(join, batches, watermarks)
    rescaled, _ = run(join, batches, watermarks, parallelism=lambda j: (2, 3, 1)[j % 3])
    assert emitted(rescaled) == emitted(one)
    assert dead(rescaled) == dead(one)


def test_rerun_of_a_batch_from_its_checkpoint_gives_the_same_output():
    batches, watermarks = late_data(8, batches=4)
    harness = ProcessHarness(IntervalJoin("ts", "ts", (-50, 50), "full", pair_ids))
    for j, (batch, w) in enumerate(zip(batches, watermarks, strict=True)):
        records = sided(
            [(e.key, e.record) for e in batch if e.side == 0],
            [(e.key, e.record) for e in batch if e.side == 1],
        )
        checkpoint = harness.checkpoint()
        first = harness.batch(records, watermark=w)
        harness.restore(checkpoint)
        assert harness.batch(records, watermark=w) == first, f"batch {j}"


def join(how="inner", between=(-10, 10)):
    return ProcessHarness(IntervalJoin("ts", "ts", between, how, select=pair_ids))


def left(key, t, i="L"):
    return (key, {"id": i, "ts": t})


def test_a_pair_in_one_batch_is_emitted_once_whichever_side_comes_first():
    for records in (
        sided([left("k", 100)], [left("k", 105, "R")]),
        [("k", Sided(1, {"id": "R", "ts": 105})), ("k", Sided(0, {"id": "L", "ts": 100}))],
    ):
        h = join()
        assert h.batch(records, watermark=0).emitted == (("L", "R"),)
        assert h.batch([], watermark=FLUSH).emitted == ()


def test_a_pair_across_batches_is_emitted_once_and_only_new_pairs_later():
    h = join(between=(0, 50))
    assert h.batch(sided([left("k", 100, "L1")], []), watermark=90).emitted == ()
    assert h.batch(sided([], [left("k", 120, "R1")]), watermark=100).emitted == (("L1", "R1"),)
    out = h.batch(sided([left("k", 110, "L2")], [left("k", 130, "R2")]), watermark=105)
    assert collections.Counter(out.emitted) == collections.Counter(
        [("L2", "R1"), ("L1", "R2"), ("L2", "R2")]
    )


def test_an_unmatched_left_row_comes_when_the_watermark_passes_its_last_partner_time():
    h = join("left", between=(-10, 10))
    assert h.batch(sided([left("k", 100)], []), watermark=100).emitted == ()
    assert h.batch([], watermark=110).emitted == ()  # a right record at 110 is still on time
    assert h.batch([], watermark=111).emitted == (("L", None),)
    assert h.keys_with_state() == []


def test_an_unmatched_right_row_comes_when_the_watermark_passes_its_time_minus_lower():
    h = join("right", between=(-10, 10))
    h.batch(sided([], [left("k", 100, "R")]), watermark=50)
    assert h.batch([], watermark=110).emitted == ()
    assert h.batch([], watermark=111).emitted == ((None, "R"),)


def test_a_matched_record_is_never_emitted_as_unmatched():
    h = join("full")
    h.batch(sided([left("k", 100)], []), watermark=0)
    assert h.batch(sided([], [left("k", 95, "R")]), watermark=0).emitted == (("L", "R"),)
    assert h.batch([], watermark=FLUSH).emitted == ()


def test_inner_join_emits_nothing_for_unmatched_records():
    h = join("inner")
    h.batch(sided([left("a", 100)], [left("b", 100, "R")]), watermark=0)
    assert h.batch([], watermark=FLUSH).emitted == ()


def test_a_record_that_can_pair_with_nothing_to_come_is_a_late_join_dead_letter():
    h = join("full", between=(-10, 10))
    h.batch(sided([left("k", 500, "L0")], []), watermark=200)
    out = h.batch(sided([left("k", 180, "L1")], [left("k", 195, "R1")]), watermark=210)
    assert [(d.reason, d.record["id"], d.key) for d in out.dead_letters] == [
        ("late_join", "L1", "k")
    ]
    assert "left record at 180" in out.dead_letters[0].error
    assert "[170, 190]" in out.dead_letters[0].error
    assert "watermark 200" in out.dead_letters[0].error
    assert out.emitted == ((None, "R1"),)  # R1 (195 + 10 >= 200) was taken, found no partner


def test_a_record_behind_the_watermark_that_can_still_pair_is_joined():
    h = join("inner", between=(0, 10))
    h.batch(sided([left("k", 300, "X")], []), watermark=100)
    out = h.batch(sided([left("k", 95)], []), watermark=100)  # 95 + 10 >= 100
    assert out.dead_letters == ()
    assert h.batch(sided([], [left("k", 104, "R")]), watermark=100).emitted == (("L", "R"),)


def test_negative_bounds_pair_right_records_before_the_left():
    h = ProcessHarness(IntervalJoin("ts", "ts", ("-1h", "-10m"), select=pair_ids))
    hour = 3_600_000
    out = h.batch(
        sided(
            [left("k", 2 * hour)],
            [left("k", hour, "R1"), left("k", 2 * hour - 600_000, "R2"), left("k", 2 * hour, "R3")],
        ),
        watermark=0,
    )
    assert out.emitted == (("L", "R1"), ("L", "R2"))


def test_times_may_be_iso_strings_datetimes_or_a_function():
    at = dt.datetime(2024, 1, 1, 12, tzinfo=dt.UTC)
    ms = int(at.timestamp() * 1000)
    h = ProcessHarness(IntervalJoin("when", lambda r: r["at"], ("0s", "1s"), select=pair_ids))
    out = h.batch(
        sided(
            [("k", {"id": "L1", "when": "2024-01-01T12:00:00Z"})],
            [
                ("k", {"id": "R1", "at": at.astimezone(PLUS_2)}),
                ("k", {"id": "R2", "at": ms + 1000}),
            ],
        ),
        watermark=0,
    )
    assert out.emitted == (("L1", "R1"), ("L1", "R2"))


def test_a_record_state_cannot_hold_fails_as_in_production():
    h = ProcessHarness(IntervalJoin("ts", "ts", (0, 10), select=pair_ids))
    naive = dt.datetime(2024, 1, 1)  # state keeps aware datetimes only (state/codec.py)
    with pytest.raises(CodecError, match="naive datetime"):
        h.batch(sided([("k", {"id": "L", "ts": naive})], []), watermark=0)


def test_records_without_a_readable_time_are_dead_letters():
    h = join("full")
    out = h.batch(
        sided([("k", {"id": "L1"}), ("k", {"id": "L2", "ts": "yesterday"})], [("k", None)]),
        watermark=0,
    )
    assert [(d.reason, d.key) for d in out.dead_letters] == [
        ("missing_event_time", "k"),
        ("bad_event_time", "k"),
        ("missing_event_time", "k"),
    ]
    assert "left record" in out.dead_letters[0].error
    assert "right record" in out.dead_letters[2].error
    assert out.emitted == ()
    assert h.keys_with_state() == []


def test_default_select_merges_the_two_records():
    h = ProcessHarness(IntervalJoin("ts", "ts", (0, 10)))
    out = h.batch(
        sided([("a1", {"auction": "a1", "ts": 5, "price": 3})],
              [("a1", {"id": "a1", "ts": 5, "price": 4, "seller": "s"})]),
        watermark=0,
    )  # fmt: skip
    assert out.emitted == (
        {"auction": "a1", "ts": 5, "price": 3, "id": "a1", "price_right": 4, "seller": "s"},
    )


def test_state_holds_each_side_until_its_last_partner_time_then_nothing():
    h = join("inner", between=(-10, 20))
    h.batch(sided([left("k", 100)], [left("k", 100, "R")]), watermark=0)
    state = h.state("k")
    assert sorted(state["left"]) == [100] and sorted(state["right"]) == [100]
    assert state["timers"] == [111, 121]  # right until 100 + 10, left until 100 + 20
    h.batch([], watermark=111)
    assert "right" not in h.state("k") and "left" in h.state("k")
    h.batch([], watermark=121)
    assert h.state("k") == {}


def test_random_bounds_against_the_reference():
    rng = random.Random(99)
    for seed in range(4):
        lower = rng.randrange(-200, 100)
        upper = lower + rng.randrange(0, 150)
        batches, watermarks = late_data(100 + seed, batches=rng.randrange(2, 15))
        join_fn = IntervalJoin("ts", "ts", (lower, upper), "full", pair_ids)
        results, _ = run(join_fn, batches, watermarks)
        want, want_late = reference(batches, watermarks, lower, upper, "full")
        assert emitted(results) == want, (lower, upper, seed)
        assert dead(results) == want_late


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"how": "outer"}, "how must be 'inner' | 'left' | 'right' | 'full': 'outer'"),
        ({"between": ("1h", "-10m")}, "lower bound '1h' (3600000 ms) is after the upper"),
        ({"between": (0,)}, "between must be (lower, upper)"),
        ({"between": "1h"}, "between must be (lower, upper)"),
        ({"between": ("ten", "1h")}, "lower bound must be a duration"),
        ({"between": (0, 1.5)}, "upper bound must be a duration"),
        ({"left_time": None}, "IntervalJoin needs left_time"),
        ({"right_time": ""}, "IntervalJoin needs right_time"),
        ({"select": "merge"}, "IntervalJoin select must be a function"),
    ],
)
def test_bad_definitions_are_refused_when_built(kwargs, message):
    args = {"left_time": "ts", "right_time": "ts", "between": (0, 10)} | kwargs
    with pytest.raises(ConfigError) as e:
        IntervalJoin(**args)
    assert message in str(e.value)


def test_records_of_a_step_with_one_input_are_refused():
    h = ProcessHarness(IntervalJoin("ts", "ts", (0, 10)))
    with pytest.raises(ConfigError, match="needs two inputs"):
        h.batch([("k", {"ts": 1})], watermark=0)
    with pytest.raises(ConfigError, match="got a record of input 2"):
        h.batch([("k", Sided(2, {"ts": 1}))], watermark=0)


def test_event_helper_is_what_the_reference_reads():
    assert Event(0, "k", 5, "L1").record == {"id": "L1", "k": "k", "ts": 5}
