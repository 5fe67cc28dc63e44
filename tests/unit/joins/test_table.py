"""TableJoin equals a plain-Python KTable reference batch by batch, with updates and
tombstones; a batch's table records come before its stream records; the last one wins."""

from __future__ import annotations

import collections
import random

import pytest

from microbatch.errors import ConfigError
from microbatch.joins import TableJoin, fields
from microbatch.runtime.process import KeyedProcessFunction, Sided
from microbatch.state.codec import CodecError
from microbatch.testing import ProcessHarness, sided


def pair_ids(stream, row):
    return (stream["id"], row["v"] if row else None)


def deleted(row):
    return row.get("deleted", False)


def changelog(seed, batches=10, keys=("a", "b", "c", "d")):
    """Per batch: stream records and table changes (values, ``None`` and ``deleted``)."""
    rng = random.Random(seed)
    out = []
    n = 0
    for _ in range(batches):
        stream, table = [], []
        for _ in range(rng.randrange(0, 12)):
            n += 1
            key = rng.choice(keys)
            roll = rng.random()
            if roll < 0.5:
                stream.append((key, {"id": f"S{n}", "k": key}))
            elif roll < 0.8:
                table.append((key, {"k": key, "v": n}))
            elif roll < 0.9:
                table.append((key, None))
            else:
                table.append((key, {"k": key, "deleted": True}))
        out.append((stream, table))
    return out


def reference(batches, how):
    table = {}
    out = []
    for stream, changes in batches:
        for key, row in changes:
            if row is None or row.get("deleted"):
                table.pop(key, None)
            else:
                table[key] = row
        got = collections.Counter()
        for key, record in stream:
            if key in table:
                got[record["id"], table[key]["v"]] += 1
            elif how == "left":
                got[record["id"], None] += 1
        out.append(got)
    return out


def run(batches, how, parallelism=None):
    harness = ProcessHarness(TableJoin(how, select=pair_ids, tombstone=deleted), 16)
    out = []
    for j, (stream, table) in enumerate(batches):
        if parallelism:
            harness.rescale(parallelism(j))
        result = harness.batch(sided(stream, table), watermark=j * 1000)
        assert result.dead_letters == ()
        out.append(collections.Counter(result.emitted))
    return out, harness


@pytest.mark.parametrize("how", ["inner", "left"])
@pytest.mark.parametrize("seed", [1, 2, 3, 4])
def test_join_with_updates_and_tombstones_equals_the_ktable_reference(how, seed):
    batches = changelog(seed)
    got, _ = run(batches, how)
    assert got == reference(batches, how)
    assert sum(got, collections.Counter()), "the data should join something"


@pytest.mark.parametrize("how", ["inner", "left"])
@pytest.mark.parametrize("seed", [1, 2, 3, 4])
def test_on_columns_with_none_deletes_the_join_equals_the_ktable_reference(how, seed):
    """``fields(...)`` and only ``None`` records as deletes (a changelog's tombstones):
    the batches are joined on columns, a delete a row of nulls that clears the key."""
    batches = [
        (stream, [(k, None if r is None or r.get("deleted") else r) for k, r in table])
        for stream, table in changelog(seed, batches=12)
    ]
    harness = ProcessHarness(TableJoin(how, select=fields(left=["id"], right=["v"])), 16)
    got, on_columns, keys = [], 0, 0
    for j, (stream, table) in enumerate(batches):
        harness.rescale((2, 3, 1)[j % 3])
        result = harness.batch(sided(stream, table))
        got.append(collections.Counter((r["id"], r["v"]) for r in result.emitted))
        on_columns += result.keys_as_columns
        keys += len({k for k, _ in stream + table})
    assert got == reference(batches, how)
    assert any(r is None for _, table in batches for _, r in table)
    assert on_columns == keys  # every key of every batch, deletes and all


def test_rescaling_between_batches_keeps_the_table():
    batches = changelog(9, batches=12)
    one, _ = run(batches, "left")
    rescaled, _ = run(batches, "left", parallelism=lambda j: (2, 3, 1)[j % 3])
    assert rescaled == one


def h(how="inner"):
    return ProcessHarness(TableJoin(how, select=pair_ids, tombstone=deleted))


def test_a_batch_table_records_come_before_its_stream_records():
    harness = h()
    out = harness.batch(sided([("k", {"id": "S1"})], [("k", {"v": 1})]))
    assert out.emitted == (("S1", 1),)


def test_the_last_change_of_a_batch_wins():
    harness = h("left")
    out = harness.batch(
        sided([("k", {"id": "S1"}), ("j", {"id": "S2"})],
              [("k", {"v": 1}), ("k", {"v": 2}), ("j", {"v": 3}), ("j", None)]),
    )  # fmt: skip
    assert out.emitted == (("S2", None), ("S1", 2))  # keys in key-byte order: "j" < "k"


def test_a_tombstone_deletes_the_value_and_the_key_state():
    for tombstone in (None, {"deleted": True}):
        harness = h("left")
        harness.batch(sided([], [("k", {"v": 1})]))
        assert harness.state("k") == {"table": {"v": 1}}
        harness.batch(sided([], [("k", tombstone)]))
        assert harness.state("k") == {}
        assert harness.batch(sided([("k", {"id": "S1"})], [])).emitted == (("S1", None),)


def test_the_value_lasts_across_batches_until_replaced():
    harness = h()
    harness.batch(sided([], [("k", {"v": 1})]))
    assert harness.batch(sided([("k", {"id": "S1"})], [])).emitted == (("S1", 1),)
    harness.batch(sided([], [("k", {"v": 2})]))
    assert harness.batch(sided([("k", {"id": "S2"})], [])).emitted == (("S2", 2),)


def test_inner_join_emits_nothing_without_a_value():
    assert h("inner").batch(sided([("k", {"id": "S1"})], [])).emitted == ()


def test_table_records_are_never_late():
    harness = h()
    harness.batch([], watermark=10**12)
    harness.batch(sided([], [("k", {"v": 1, "ts": 0})]))
    assert harness.batch(sided([("k", {"id": "S1"})], [])).emitted == (("S1", 1),)


def test_default_select_merges_the_stream_record_and_the_row():
    harness = ProcessHarness(TableJoin("left"))
    harness.batch(sided([], [("c1", {"id": "c1", "name": "Ada", "city": "Oslo"})]))
    out = harness.batch(
        sided([("c1", {"order": 7, "customer": "c1"}), ("c2", {"order": 8, "customer": "c2"})], [])
    )
    assert out.emitted == (
        {"order": 7, "customer": "c1", "id": "c1", "name": "Ada", "city": "Oslo"},
        {"order": 8, "customer": "c2"},
    )


def test_a_row_state_cannot_hold_fails_as_in_production():
    with pytest.raises(CodecError, match="set"):
        h().batch(sided([], [("k", {"v": {1, 2}})]))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"how": "full"}, "TableJoin how must be 'inner' | 'left': 'full'"),
        ({"tombstone": "deleted"}, "TableJoin tombstone must be a function"),
        ({"select": 3}, "TableJoin select must be a function"),
    ],
)
def test_bad_definitions_are_refused_when_built(kwargs, message):
    with pytest.raises(ConfigError) as e:
        TableJoin(**kwargs)
    assert message in str(e.value)


@pytest.mark.parametrize("how", ["inner", "left"])
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_keys_joined_at_once_give_exactly_what_process_gives_key_by_key(how, seed, monkeypatch):
    """``process_batch`` takes every key: output in the same order, the same state."""
    keys = [f"k{i}" for i in range(8)]
    rng = random.Random(seed)
    fed = []
    for stream, table in changelog(seed, batches=24, keys=keys):  # sides interleaved
        pairs = [(k, Sided(0, r)) for k, r in stream] + [(k, Sided(1, r)) for k, r in table]
        rng.shuffle(pairs)
        fed.append(pairs)

    def run_all():
        harness = ProcessHarness(TableJoin(how, pair_ids, deleted), max_parallelism=16)
        out = []
        for j, pairs in enumerate(fed):
            harness.rescale((2, 3, 1)[j % 3])
            out.append(harness.batch(pairs))
        return out, {k: harness.state(k) for k in harness.keys_with_state()}

    at_once, state = run_all()
    monkeypatch.setattr(TableJoin, "process_batch", KeyedProcessFunction.process_batch)
    by_key, want_state = run_all()

    assert [r.emitted for r in at_once] == [r.emitted for r in by_key]
    assert state == want_state and len(state) >= 3
    assert sum(r.keys_batched for r in at_once) == sum(len({k for k, _ in p}) for p in fed)
    assert sum(len(r.emitted) for r in at_once) > 10


def test_a_key_whose_select_raises_is_left_to_process_with_its_state_untouched():
    def select(stream, row):
        if stream["id"] == "boom":
            raise RuntimeError("no row for boom")
        return (stream["id"], row["v"])

    harness = ProcessHarness(TableJoin(select=select))
    harness.batch(sided([], [("a", {"v": 1}), ("b", {"v": 2})]))
    start = harness.checkpoint()
    with pytest.raises(RuntimeError, match="no row for boom"):
        harness.batch(sided([("a", {"id": "S1"}), ("b", {"id": "boom"})], [("b", {"v": 3})]))
    harness.restore(start)
    out = harness.batch(sided([("a", {"id": "S2"}), ("b", {"id": "S3"})], []))
    assert out.emitted == (("S2", 1), ("S3", 2))
    assert out.keys_batched == 2
