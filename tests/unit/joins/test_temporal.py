"""TemporalJoin equals a plain-Python as-of reference batch by batch on out-of-order data
with late records; left records wait for the watermark; versions live for the retention."""

from __future__ import annotations

import collections

import pytest

from microbatch.errors import ConfigError
from microbatch.joins import TemporalJoin
from microbatch.testing import ProcessHarness, sided
from tests.unit.joins.streams import (
    FLUSH,
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


def reference(batches, watermarks, retention, how):
    """Per batch: the joined rows and the late records.

    Late: a left record more than ``retention`` behind its batch's starting watermark; a
    right version older than a version of an earlier batch at or before that watermark
    minus the retention. A left record is emitted in the first batch whose watermark
    passes its time, with the newest version at or before its time that has arrived by
    then (equal times: the later arrival)."""
    begin = starts(watermarks)
    versions, pending = [], []
    late = [collections.Counter() for _ in batches]
    out = [collections.Counter() for _ in batches]
    for j, batch in enumerate(batches):
        horizon = None if begin[j] is None else begin[j] - retention
        earlier = list(versions)
        for pos, e in enumerate(batch):
            if e.side == 1:
                in_force = None
                if horizon is not None:
                    times = [v.t for v, *_ in earlier if v.key == e.key and v.t <= horizon]
                    in_force = max(times, default=None)
                if in_force is not None and e.t < in_force:
                    late[j]["late_join", e.id] += 1
                else:
                    versions.append((e, j, pos))
            elif horizon is not None and e.t < horizon:
                late[j]["late_join", e.id] += 1
            else:
                pending.append((e, j))
    for e, b in pending:
        due = [j for j in range(b, len(batches)) if (watermarks[j] or -FLUSH) > e.t]
        if not due:
            continue
        known = [
            (v.t, vb, pos, v.id)
            for v, vb, pos in versions
            if v.key == e.key and v.t <= e.t and vb <= due[0]
        ]
        if known:
            out[due[0]][e.id, max(known)[3]] += 1
        elif how == "left":
            out[due[0]][e.id, None] += 1
    return out, late


def late_data(seed, batches=8):
    arrived = arrival_order(events(seed, 60), seed, disorder=100, late_share=0.2)
    cut = [*split(arrived, seed, batches), []]
    return cut, [*lagging_watermarks(cut[:-1], lateness=50), FLUSH]


@pytest.mark.parametrize("how", ["inner", "left"])
@pytest.mark.parametrize(("seed", "retention"), [(1, 1), (2, 30), (3, 150), (4, 600), (5, 60)])
def test_join_on_late_out_of_order_data_equals_the_reference_batch_by_batch(how, seed, retention):
    batches, watermarks = late_data(seed)
    join = TemporalJoin("ts", "ts", retention, select=pair_ids, how=how)
    results, harness = run(join, batches, watermarks)
    want, want_late = reference(batches, watermarks, retention, how)
    assert sum(want_late, collections.Counter()), "the data should have late records"
    assert emitted(results) == want
    assert dead(results) == want_late
    for key in "abc":  # after the flush: no waiting record, one version per key
        state = harness.state(key)
        assert "pending" not in state and len(state.get("versions", {})) <= 1


def test_many_batches_and_rescales_equal_the_reference():
    batches, watermarks = late_data(6, batches=25)
    join = TemporalJoin("ts", "ts", 40, select=pair_ids, how="left")
    results, _ = run(join, batches, watermarks, parallelism=lambda j: (2, 3, 1)[j % 3])
    want, want_late = reference(batches, watermarks, 40, "left")
    assert emitted(results) == want
    assert dead(results) == want_late


@pytest.mark.parametrize("n_batches", [1, 3, 10, 120])
def test_output_without_late_records_does_not_depend_on_batching(n_batches):
    evs = events(12, 60)
    arrived = arrival_order(evs, 12, disorder=300, late_share=0.0)
    batches = split(arrived, n_batches, n_batches)
    results, _ = run(
        TemporalJoin("ts", "ts", "1s", select=pair_ids, how="left"),
        batches,
        safe_watermarks(batches),
    )
    assert all(not r.dead_letters for r in results)
    want = collections.Counter()
    for le in (e for e in arrived if e.side == 0):
        # the newest version at or before, equal times: the later arrival
        known = [(r.t, i, r.id) for i, r in enumerate(arrived) if r.side == 1 and r.key == le.key]
        best = max((k for k in known if k[0] <= le.t), default=None)
        want[le.id, best and best[2]] += 1
    assert sum(emitted(results), collections.Counter()) == want


def h(how="inner", retention=100):
    return ProcessHarness(TemporalJoin("ts", "ts", retention, select=pair_ids, how=how))


def rec(key, t, i):
    return (key, {"id": i, "ts": t})


def test_a_record_joins_the_newest_version_at_or_before_its_time():
    harness = h()
    harness.batch(sided([], [rec("k", 10, "V10"), rec("k", 20, "V20"), rec("k", 30, "V30")]))
    out = harness.batch(
        sided([rec("k", 5, "L5"), rec("k", 20, "L20"), rec("k", 29, "L29")], []), watermark=40
    )
    assert out.emitted == (("L20", "V20"), ("L29", "V20"))  # L5 has no version: inner


def test_a_record_waits_until_the_watermark_passes_its_time():
    harness = h()
    assert harness.batch(sided([rec("k", 50, "L")], []), watermark=49).emitted == ()
    harness.batch(sided([], [rec("k", 50, "V50")]), watermark=50)  # still on time at 50
    assert harness.batch([], watermark=50).emitted == ()
    assert harness.batch([], watermark=51).emitted == (("L", "V50"),)
    assert "pending" not in harness.state("k")


def test_a_version_arriving_after_the_record_but_on_time_is_used():
    harness = h()
    harness.batch(sided([], [rec("k", 10, "V10")]), watermark=20)
    harness.batch(sided([rec("k", 40, "L")], []), watermark=30)
    harness.batch(sided([], [rec("k", 35, "V35")]), watermark=35)
    assert harness.batch([], watermark=100).emitted == (("L", "V35"),)


def test_left_join_emits_records_without_a_version_with_none():
    harness = h("left")
    assert harness.batch(sided([rec("k", 5, "L")], []), watermark=10).emitted == (("L", None),)


def test_versions_older_than_the_one_in_force_at_the_retention_horizon_are_dropped():
    harness = h(retention=100)
    harness.batch(
        sided([], [rec("k", 10, "V10"), rec("k", 20, "V20"), rec("k", 300, "V300")]),
        watermark=50,
    )
    assert sorted(harness.state("k")["versions"]) == [10, 20, 300]
    harness.batch([], watermark=130)  # horizon 30: V20 is in force there, V10 is not needed
    assert sorted(harness.state("k")["versions"]) == [20, 300]
    harness.batch([], watermark=10**9)
    assert sorted(harness.state("k")["versions"]) == [300]  # the last version stays


def test_a_record_more_than_the_retention_behind_the_watermark_is_late():
    harness = h(retention=100)
    harness.batch(sided([], [rec("k", 10, "V10")]), watermark=500)
    out = harness.batch(sided([rec("k", 399, "L399"), rec("k", 400, "L400")], []), watermark=500)
    assert [(d.reason, d.record["id"]) for d in out.dead_letters] == [("late_join", "L399")]
    assert "left record at 399" in out.dead_letters[0].error
    assert "watermark 500" in out.dead_letters[0].error
    assert out.emitted == (("L400", "V10"),)  # within the retention: joined in this batch


def test_a_version_superseded_at_the_horizon_is_late():
    harness = h(retention=100)
    harness.batch(sided([], [rec("k", 300, "V300")]), watermark=500)
    out = harness.batch(sided([], [rec("k", 250, "V250"), rec("k", 450, "V450")]), watermark=500)
    assert [(d.reason, d.record["id"]) for d in out.dead_letters] == [("late_join", "V250")]
    assert "older than the version at 300" in out.dead_letters[0].error
    assert sorted(harness.state("k")["versions"]) == [300, 450]


def test_an_old_first_version_is_still_taken():
    harness = h(retention=100)
    harness.batch([], watermark=10_000)
    out = harness.batch(sided([rec("k", 9_950, "L")], [rec("k", 5, "V5")]), watermark=10_000)
    assert out.dead_letters == () and out.emitted == (("L", "V5"),)


def test_same_time_versions_the_later_one_wins():
    harness = h()
    harness.batch(sided([], [rec("k", 10, "A"), rec("k", 10, "B")]))
    harness.batch(sided([rec("k", 10, "L1")], []), watermark=11)
    harness.batch(sided([], [rec("k", 12, "C"), rec("k", 12, "D")]), watermark=11)
    harness.batch(sided([], [rec("k", 12, "E")]), watermark=11)
    assert harness.batch(sided([rec("k", 20, "L2")], []), watermark=21).emitted == (("L2", "E"),)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"retention": None}, "TemporalJoin needs a retention"),
        ({"retention": 0}, "TemporalJoin retention must be positive: 0"),
        ({"retention": "-1h"}, "TemporalJoin retention must be a duration"),
        ({"how": "right"}, "TemporalJoin how must be 'inner' | 'left': 'right'"),
        ({"left_time": None}, "TemporalJoin needs left_time"),
        ({"right_time": 5}, "TemporalJoin needs right_time"),
    ],
)
def test_bad_definitions_are_refused_when_built(kwargs, message):
    args = {"left_time": "ts", "right_time": "ts", "retention": "1h"} | kwargs
    with pytest.raises(ConfigError) as e:
        TemporalJoin(**args)
    assert message in str(e.value)
