"""WindowJoin equals a plain-Python reference batch by batch on out-of-order data with
late records, for tumbling and hopping windows; pairs come when the window closes."""

from __future__ import annotations

import collections
import copy
import datetime as dt
import pickle
import random

import pytest

from microbatch import windows
from microbatch.errors import ConfigError
from microbatch.joins import WindowJoin
from microbatch.runtime.process import KeyedProcessFunction, Sided
from microbatch.testing import ProcessHarness, sided
from microbatch.windows import Hopping, Session, Tumbling
from tests.unit.joins.streams import (
    FLUSH,
    arrival_order,
    dead,
    events,
    lagging_watermarks,
    pair_ids,
    run,
    safe_watermarks,
    split,
    starts,
)

SPECS = [Tumbling(200), Hopping(300, 100), Hopping(250, 100), Tumbling(1)]


def starts_of(t, spec):
    """Every ``s`` with ``s <= t < s + size``, ``s`` a multiple of the hop (or size)."""
    every = spec.every_ms if isinstance(spec, Hopping) else spec.size_ms
    first = (t - spec.size_ms) // every + 1
    return [k * every for k in range(first, t // every + 1)]


def reference(batches, watermarks, spec):
    begin = starts(watermarks)
    size = spec.size_ms
    held = collections.defaultdict(lambda: ([], []))
    late = [collections.Counter() for _ in batches]
    for j, batch in enumerate(batches):
        for e in batch:
            open_ = [s for s in starts_of(e.t, spec) if begin[j] is None or s + size > begin[j]]
            if not open_:
                late[j]["late_join", e.id] += 1
            for s in open_:
                held[e.key, s][e.side].append(e.id)
    out = [collections.Counter() for _ in batches]
    for (_, s), (lefts, rights) in held.items():
        due = [j for j, w in enumerate(watermarks) if w is not None and w >= s + size]
        for lid in lefts:
            for rid in rights:
                out[due[0]][lid, rid, s, s + size] += 1
    return out, late


def windowed(results):
    return [
        collections.Counter(
            (o["id"], o["id_right"], o["window_start"], o["window_end"]) for o in r.emitted
        )
        for r in results
    ]


@pytest.mark.parametrize("spec", SPECS, ids=str)
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_join_on_late_out_of_order_data_equals_the_reference_batch_by_batch(spec, seed):
    arrived = arrival_order(events(seed, 60), seed, disorder=100, late_share=0.2)
    batches = [*split(arrived, seed, 8), []]
    watermarks = [*lagging_watermarks(batches[:-1], lateness=50), FLUSH]
    results, harness = run(WindowJoin("ts", "ts", spec), batches, watermarks)
    want, want_late = reference(batches, watermarks, spec)
    assert sum(want_late, collections.Counter()), "the data should have late records"
    assert windowed(results) == want
    assert dead(results) == want_late
    assert harness.keys_with_state() == []


@pytest.mark.parametrize("n_batches", [1, 4, 30])
def test_output_without_late_records_does_not_depend_on_batching(n_batches):
    spec = Hopping(300, 100)
    evs = events(21, 50)
    arrived = arrival_order(evs, 21, disorder=300, late_share=0.0)
    batches = split(arrived, n_batches, n_batches)
    results, _ = run(WindowJoin("ts", "ts", spec), batches, safe_watermarks(batches))
    want = collections.Counter()
    for le in (e for e in evs if e.side == 0):
        for re_ in (e for e in evs if e.side == 1 and e.key == le.key):
            for s in set(starts_of(le.t, spec)) & set(starts_of(re_.t, spec)):
                want[le.id, re_.id, s, s + 300] += 1
    assert sum(windowed(results), collections.Counter()) == want


def test_rescaling_between_batches_changes_no_output():
    arrived = arrival_order(events(4, 60), 4, disorder=100, late_share=0.2)
    batches = split(arrived, 4, 9)
    watermarks = lagging_watermarks(batches, lateness=50)
    join = WindowJoin("ts", "ts", Hopping(300, 100))
    one, _ = run(join, batches, watermarks)
    rescaled, _ = run(join, batches, watermarks, parallelism=lambda j: (2, 3, 1)[j % 3])
    assert windowed(rescaled) == windowed(one)
    assert dead(rescaled) == dead(one)


def rec(key, t, i):
    return (key, {"id": i, "ts": t})


def test_a_window_is_emitted_when_the_watermark_reaches_its_end_then_forgotten():
    harness = ProcessHarness(WindowJoin("ts", "ts", "100ms"))
    harness.batch(sided([rec("k", 10, "L1"), rec("k", 20, "L2")], [rec("k", 99, "R1")]))
    assert harness.batch([], watermark=99).emitted == ()
    out = harness.batch(sided([], [rec("k", 150, "R2")]), watermark=100)
    assert out.emitted == (
        {"id": "L1", "ts": 10, "id_right": "R1", "ts_right": 99, "window_start": 0,
         "window_end": 100},
        {"id": "L2", "ts": 20, "id_right": "R1", "ts_right": 99, "window_start": 0,
         "window_end": 100},
    )  # fmt: skip
    assert harness.state("k") == {"right": {100: [{"id": "R2", "ts": 150}]}, "timers": [200]}
    assert harness.batch([], watermark=200).emitted == ()  # no left record there
    assert harness.state("k") == {}


def test_a_hopping_record_joins_its_open_windows_and_is_late_only_when_all_closed():
    harness = ProcessHarness(WindowJoin("ts", "ts", windows.hopping("300ms", "100ms")))
    harness.batch(sided([], [rec("k", 450, "R")]), watermark=400)
    out = harness.batch(sided([rec("k", 350, "L1"), rec("k", 150, "L2")], []), watermark=400)
    assert [(d.reason, d.record["id"]) for d in out.dead_letters] == [("late_join", "L2")]
    assert "left record at 150" in out.dead_letters[0].error
    assert "[-100, 200), [0, 300), [100, 400)" in out.dead_letters[0].error
    out = harness.batch([], watermark=FLUSH)
    assert sorted((o["id"], o["window_start"]) for o in out.emitted) == [
        ("L1", 200),
        ("L1", 300),
    ]


def test_a_custom_select_gets_the_window_fields_only_on_dicts():
    harness = ProcessHarness(WindowJoin("ts", "ts", 100, select=lambda a, b: (a["id"], b["id"])))
    harness.batch(sided([rec("k", 1, "L")], [rec("k", 2, "R")]))
    assert harness.batch([], watermark=100).emitted == (("L", "R"),)


@pytest.mark.parametrize("window", ["5m", 300_000, Tumbling("5m"), windows.tumbling("5m")])
def test_a_window_is_a_size_a_spec_or_a_builder(window):
    assert WindowJoin("ts", "ts", window).window == Tumbling(300_000)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"window": Session("5m")}, "WindowJoin window must be a tumbling size"),
        ({"window": None}, "WindowJoin window must be a tumbling size"),
        ({"window": "-5m"}, "tumbling window size must be a duration"),
        ({"left_time": None}, "WindowJoin needs left_time"),
        ({"select": 1}, "WindowJoin select must be a function"),
    ],
)
def test_bad_definitions_are_refused_when_built(kwargs, message):
    args = {"left_time": "ts", "right_time": "ts", "window": "5m"} | kwargs
    with pytest.raises(ConfigError) as e:
        WindowJoin(**args)
    assert message in str(e.value)


# A window that closes in the batch its records came in is emitted by process ----------


def pairs_of(emitted):
    return [(o["id"], o["id_right"], o["window_start"]) for o in emitted]


def by_window(pairs):
    """Each window's pairs, in the order emitted (ids ``L<key>..``/``R<key>..``)."""
    out = collections.defaultdict(list)
    for lid, rid, s in pairs:
        out[lid[1], s].append((lid, rid))
    return dict(out)


def test_a_window_closing_in_its_own_batch_emits_as_if_its_records_had_waited_in_state():
    spec = Hopping(300, 100)
    first = sided([rec("a", 150, "La0"), rec("b", 120, "Lb0")], [rec("a", 160, "Ra0")])
    second = sided(
        [rec("a", 250, "La1"), rec("b", 140, "Lb1"), rec("c", 30, "Lc1")],
        [rec("a", 180, "Ra1"), rec("b", 299, "Rb1"), rec("c", 90, "Rc1")],
    )
    waited = ProcessHarness(WindowJoin("ts", "ts", spec), max_parallelism=8, parallelism=2)
    waited.batch(first, watermark=0)
    waited.batch(second, watermark=0)  # every window still open: all in state
    in_state = waited.batch([], watermark=FLUSH).emitted
    direct = ProcessHarness(WindowJoin("ts", "ts", spec), max_parallelism=8, parallelism=2)
    direct.batch(first, watermark=0)
    at_once = direct.batch(second, watermark=FLUSH).emitted  # close in the same batch
    # the same pairs, each window's in the same order (the windows in key order)
    assert by_window(pairs_of(at_once)) == by_window(pairs_of(in_state))
    assert len(at_once) == len(in_state)
    assert ("La0", "Ra1", 0) in pairs_of(at_once)  # a window's records from both batches
    assert direct.keys_with_state() == waited.keys_with_state() == []


def test_a_window_closing_in_its_batch_is_emitted_by_process_without_a_timer():
    harness = ProcessHarness(WindowJoin("ts", "ts", 100, select=pair_ids))
    out = harness.batch(
        sided([rec("k", 10, "L1"), rec("k", 20, "L2")], [rec("k", 30, "R1"), rec("k", 5, "R0")]),
        watermark=100,
    )
    assert out.emitted == (("L1", "R0"), ("L1", "R1"), ("L2", "R0"), ("L2", "R1"))
    assert out.timers_fired == 0  # emitted by process: no state, no timer
    assert harness.keys_with_state() == []


def failing_on_boom(message):
    """A ``select`` of the ids that raises ``message`` for the left record ``boom``."""

    def select(left, right):
        if left["id"] == "boom":
            raise RuntimeError(message)
        return (left["id"], right["id"])

    return select


def test_a_batch_that_failed_leaves_nothing_for_a_later_one():
    harness = ProcessHarness(WindowJoin("ts", "ts", 100, select=failing_on_boom("failed")))
    start = harness.checkpoint()
    with pytest.raises(RuntimeError, match="failed"):
        # a's window [0, 100) is emitted first and fails; b's [100, 200) would come next
        harness.batch(
            sided([rec("a", 10, "boom"), rec("b", 110, "L-gone")],
                  [rec("a", 20, "R"), rec("b", 120, "R-gone")]),
            watermark=300,
        )  # fmt: skip
    harness.restore(start)
    harness.batch(sided([rec("b", 130, "L")], [rec("b", 140, "R")]), watermark=150)
    assert harness.batch([], watermark=300).emitted == (("L", "R"),)


def test_a_join_that_ran_still_pickles_and_copies():
    join = WindowJoin("ts", "ts", 100, select=pair_ids)
    harness = ProcessHarness(join)
    harness.batch(sided([rec("k", 10, "L")], [rec("k", 20, "R")]), watermark=100)
    for twin in (pickle.loads(pickle.dumps(join)), copy.deepcopy(join)):
        again = ProcessHarness(twin).batch(
            sided([rec("k", 10, "L")], [rec("k", 20, "R")]), watermark=100
        )
        assert again.emitted == (("L", "R"),)


def test_a_window_that_closes_in_its_batch_needs_no_timer_and_leaves_nothing():
    harness = ProcessHarness(WindowJoin("ts", "ts", 100, select=pair_ids))
    out = harness.batch(
        sided([rec("alone", 10, "L"), rec("both", 20, "L1"), rec("both", 30, "L2")],
              [rec("both", 40, "R"), rec("right-only", 50, "R-alone")]),
        watermark=100,
    )  # fmt: skip
    assert out.emitted == (("L1", "R"), ("L2", "R"))
    assert out.timers_fired == 0
    assert harness.keys_with_state() == []


def test_a_closing_window_takes_its_earlier_records_from_state_and_deletes_their_timer():
    harness = ProcessHarness(WindowJoin("ts", "ts", 100, select=pair_ids))
    harness.batch(sided([rec("k", 10, "L0"), rec("j", 10, "J0")], []), watermark=0)
    assert harness.state("k") == {"left": {0: [{"id": "L0", "ts": 10}]}, "timers": [100]}
    # k: more left records only, the window closes: dropped; j: a right record pairs it
    out = harness.batch(sided([rec("k", 20, "L1")], [rec("j", 30, "R1")]), watermark=100)
    assert out.emitted == (("J0", "R1"),)
    assert out.timers_fired == 0  # both windows' timers deleted by process
    assert harness.keys_with_state() == []


def _mixed_batches(seed: int) -> tuple[list[list[tuple[str, Sided]]], list[int | None]]:
    """Many keys, out of order, some records late, sides interleaved as a source order
    interleaves them; a few times an ISO-8601 string or missing (read per record)."""
    rng = random.Random(seed)
    keys = [f"k{i:03}" for i in range(100)]
    arrived = arrival_order(events(seed, 600, keys, span=3_000), seed, 100, late_share=0.1)
    batches = [*split(arrived, seed, 6), []]
    watermarks = [*lagging_watermarks(batches[:-1], lateness=50), FLUSH]
    fed = []
    for batch in batches:
        pairs = []
        for e in batch:
            record = dict(e.record)
            roll = rng.random()
            if roll < 0.02:
                record["ts"] = dt.datetime.fromtimestamp(e.t / 1000, dt.UTC).isoformat()
            elif roll < 0.03:
                del record["ts"]
            pairs.append((e.key, Sided(e.side, record)))
        fed.append(pairs)
    return fed, watermarks


@pytest.mark.parametrize("spec", SPECS, ids=str)
@pytest.mark.parametrize("seed", [4, 5])
def test_keys_joined_at_once_give_exactly_what_process_gives_key_by_key(spec, seed, monkeypatch):
    fed, watermarks = _mixed_batches(seed)

    def run_all(harness):
        out = []
        for j, (pairs, w) in enumerate(zip(fed, watermarks, strict=True)):
            harness.rescale((2, 3, 1)[j % 3])
            out.append(harness.batch(pairs, watermark=w))
        return out, {k: harness.state(k) for k in harness.keys_with_state()}

    at_once, state = run_all(ProcessHarness(WindowJoin("ts", "ts", spec), max_parallelism=16))
    monkeypatch.setattr(WindowJoin, "process_batch", KeyedProcessFunction.process_batch)
    by_key, want_state = run_all(ProcessHarness(WindowJoin("ts", "ts", spec), max_parallelism=16))

    assert [r.emitted for r in at_once] == [r.emitted for r in by_key]  # in the same order
    assert [r.dead_letters for r in at_once] == [r.dead_letters for r in by_key]
    assert [r.timers_fired for r in at_once] == [r.timers_fired for r in by_key]
    assert state == want_state
    assert sum(r.keys_batched for r in by_key) == 0
    batched = sum(r.keys_batched for r in at_once)
    assert batched > 25, f"only {batched} keys were joined at once"
    assert any(d.reason == "late_join" for r in at_once for d in r.dead_letters)
    assert any(d.reason == "missing_event_time" for r in at_once for d in r.dead_letters)


def test_a_key_whose_select_raises_is_left_to_process_which_fails_as_before():
    select = failing_on_boom("no pair for boom")
    harness = ProcessHarness(WindowJoin("ts", "ts", 100, select=select))
    ok = harness.batch(sided([rec("a", 10, "L")], [rec("a", 20, "R")]), watermark=300)
    assert ok.emitted == (("L", "R"),)
    assert ok.keys_batched == 1
    with pytest.raises(RuntimeError, match="no pair for boom"):
        harness.batch(sided([rec("b", 310, "boom")], [rec("b", 320, "R")]), watermark=500)
