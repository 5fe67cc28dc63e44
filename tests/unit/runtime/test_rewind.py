"""Where a backfill starts: the lineage walk, without services."""

from __future__ import annotations

from typing import Any

import pytest

from microbatch.checkpoint import Manifest
from microbatch.errors import CheckpointError
from microbatch.runtime.rewind import batch_end_ms, find_rewind_target

MIN = 60_000


def manifest(cid: int, **metadata: Any) -> Manifest:
    return Manifest(
        checkpoint_id=cid,
        pipeline_fingerprint="f",
        max_parallelism=4,
        parallelism=1,
        key_groups=(None,) * 4,
        full_checkpoint_id=cid,
        created_at="",
        metadata=metadata,
    )


def batch(cid: int, start: int | None, until: int | None, base: int | None, **extra: Any):
    meta = {"until_timestamp_ms": until, "interval_start_ms": start, "base_checkpoint": base,
            "processing_time_ms": 99 * MIN}  # fmt: skip
    if base is None:
        meta["from_offsets"] = {"t": {"0": 0}}
    return manifest(cid, batch=meta, offsets={"t": {"0": 10 * (cid + 1)}}, **extra)


def lineage(*manifests: Manifest):
    by_id = {m.checkpoint_id: m for m in manifests}
    return by_id, by_id.get


def test_a_pipeline_at_or_before_the_interval_start_needs_no_rewind() -> None:
    by_id, load = lineage(batch(0, 0, 5 * MIN, None), batch(1, 5 * MIN, 10 * MIN, 0))
    assert find_rewind_target("p", by_id[1], 10 * MIN, load) is None  # next interval
    assert find_rewind_target("p", by_id[1], 15 * MIN, load) is None  # catching up
    assert find_rewind_target("p", None, 0, load) is None  # no checkpoint yet


def test_a_backfill_rewinds_to_the_checkpoint_that_ended_at_the_interval_start() -> None:
    by_id, load = lineage(
        batch(0, 0, 5 * MIN, None), batch(1, 5 * MIN, 10 * MIN, 0), batch(2, 10 * MIN, 15 * MIN, 1)
    )
    target = find_rewind_target("p", by_id[2], 5 * MIN, load)
    assert target is not None
    assert (target.checkpoint_id, target.undone_from, target.at_ms) == (0, 1, 5 * MIN)
    assert target.offsets == {("t", 0): 10}


def test_the_first_interval_rewinds_to_before_the_first_batch() -> None:
    by_id, load = lineage(batch(0, 0, 5 * MIN, None), batch(1, 5 * MIN, 10 * MIN, 0))
    target = find_rewind_target("p", by_id[1], 0, load)
    assert target is not None and target.manifest is None
    assert (target.undone_from, target.offsets) == (0, {("t", 0): 0})


def test_a_replay_copy_stands_for_its_source_even_once_retention_removed_it() -> None:
    source = batch(0, 0, 5 * MIN, None)
    copy = manifest(3, batch=source.metadata["batch"], offsets={"t": {"0": 10}},
                    replayed_from={"checkpoint_id": 0, "undone": [1, 2]})  # fmt: skip
    by_id, load = lineage(copy, batch(4, 5 * MIN, 10 * MIN, 3), batch(5, 10 * MIN, 15 * MIN, 4))
    target = find_rewind_target("p", by_id[5], 5 * MIN, load)
    assert target is not None and (target.checkpoint_id, target.undone_from) == (3, 4)
    target = find_rewind_target("p", by_id[5], 0, load)  # before the first batch
    assert target is not None and target.manifest is None and target.undone_from == 0


def test_the_walk_follows_replays_so_a_backfill_can_run_twice() -> None:
    first = [batch(0, 0, 5 * MIN, None), batch(1, 5 * MIN, 10 * MIN, 0),
             batch(2, 10 * MIN, 15 * MIN, 1)]  # fmt: skip
    replay = manifest(3, replayed_from={"checkpoint_id": 0, "undone": [1, 2]},
                      offsets={"t": {"0": 10}})  # fmt: skip
    again = [batch(4, 5 * MIN, 10 * MIN, 3), batch(5, 10 * MIN, 15 * MIN, 4)]
    by_id, load = lineage(*first, replay, *again)
    target = find_rewind_target("p", by_id[5], 5 * MIN, load)
    assert target is not None and target.checkpoint_id == 0  # the state the replay copied
    assert target.undone_from == 1
    # Right after the rewind the pipeline stands at the interval start: no second rewind.
    by_id, load = lineage(*first, replay)
    assert find_rewind_target("p", by_id[3], 5 * MIN, load) is None


def test_a_rewind_to_before_the_first_batch_is_itself_a_valid_start() -> None:
    initial = manifest(2, replayed_from={"checkpoint_id": None, "undone": [0, 1]},
                       batch={"until_timestamp_ms": 0, "base_checkpoint": None})  # fmt: skip
    by_id, load = lineage(batch(0, 0, 5 * MIN, None), batch(1, 5 * MIN, 10 * MIN, 0), initial,
                          batch(3, 0, 5 * MIN, 2))  # fmt: skip
    assert find_rewind_target("p", by_id[2], 0, load) is None
    target = find_rewind_target("p", by_id[3], 0, load)
    assert target is not None and target.checkpoint_id == 2


def test_a_boundary_no_retained_checkpoint_ended_at_is_refused_with_the_ones_that_exist() -> None:
    by_id, load = lineage(batch(1, 5 * MIN, 10 * MIN, 0), batch(2, 10 * MIN, 15 * MIN, 1))
    with pytest.raises(CheckpointError) as err:  # checkpoint 0 was removed by retention
        find_rewind_target("clicks", by_id[2], 5 * MIN, load)
    message = str(err.value)
    assert "pipeline 'clicks'" in message and "retain_checkpoints" in message
    assert "00:10:00" in message and "00:15:00" in message
    with pytest.raises(CheckpointError, match="no retained checkpoint ended there"):
        find_rewind_target("clicks", by_id[2], 7 * MIN, load)  # not a batch boundary


def test_a_batch_that_did_not_stop_exactly_at_its_end_is_no_start() -> None:
    capped = batch(1, 5 * MIN, 10 * MIN, 0)
    capped.metadata["batch"]["ends_exactly"] = False  # a record limit stopped it early
    by_id, load = lineage(batch(0, 0, 5 * MIN, None), capped, batch(2, 10 * MIN, 15 * MIN, 1))
    with pytest.raises(CheckpointError, match="no retained checkpoint ended there"):
        find_rewind_target("p", by_id[2], 10 * MIN, load)


def test_a_backfill_from_before_the_first_interval_starts_from_the_beginning() -> None:
    # The first batch read everything before its end (a DAG's first run, catchup off).
    by_id, load = lineage(batch(0, 15 * MIN, 20 * MIN, None), batch(1, 20 * MIN, 25 * MIN, 0))
    target = find_rewind_target("p", by_id[1], 5 * MIN, load)
    assert target is not None and target.manifest is None and target.at_ms == 5 * MIN


def test_a_run_without_interval_end_counts_as_ending_when_it_was_planned() -> None:
    manual = batch(0, None, None, None)
    assert batch_end_ms(manual) == 99 * MIN
    by_id, load = lineage(manual)
    assert find_rewind_target("p", by_id[0], 100 * MIN, load) is None  # not past it
    target = find_rewind_target("p", by_id[0], 5 * MIN, load)  # from the beginning
    assert target is not None and target.manifest is None
