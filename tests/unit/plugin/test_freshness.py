"""When is a batch worth running? The skip-when-idle rules over real manifests."""

from __future__ import annotations

from microbatch.checkpoint import Manifest
from microbatch.kafka import TopicPartition
from microbatch_airflow.freshness import Decision, PipelineFacts, decide

FACTS = PipelineFacts("clicks", "file:///tmp/x", ("clicks",), allowed_lateness_s=60.0,
                      idle_timeout_s=30.0)  # fmt: skip
NOW = 1_767_225_600_000
P0, P1 = TopicPartition("clicks", 0), TopicPartition("clicks", 1)


def manifest(offsets: dict, *, event_time: dict | None = None, pending: dict | None = None):
    return Manifest(
        checkpoint_id=7,
        pipeline_fingerprint="f",
        max_parallelism=4,
        parallelism=2,
        key_groups=(None,) * 4,
        full_checkpoint_id=7,
        created_at="2026-01-01T00:00:00+00:00",
        metadata={"offsets": offsets, "event_time": event_time, "enrich_pending": pending},
    )


def active_partitions(last_seen_ms: int) -> dict:
    """Both partitions had records at ``last_seen_ms``; watermark = 1000 - 60 s."""
    return {
        "watermark": 1_000 - 60_000,
        "partitions": {"clicks/0": [1_000, last_seen_ms], "clicks/1": [5_000, last_seen_ms]},
    }


def test_no_checkpoint_yet_runs_the_first_batch():
    assert decide(FACTS, None, {}, NOW).run


def test_unpublished_commit_runs_to_publish_it():
    d = decide(FACTS, manifest({"clicks": {"0": 5}}), {P0: 5}, NOW, published=False)

    assert d.run and "unpublished" in d.reason


def test_new_offsets_run_and_report_the_lag():
    d = decide(FACTS, manifest({"clicks": {"0": 5, "1": 9}}), {P0: 8, P1: 9}, NOW)

    assert d == Decision(True, d.reason, 3, {"clicks[0]": 3, "clicks[1]": 0})
    assert "3 new offsets since checkpoint 7" in d.reason


def test_a_partition_the_checkpoint_has_not_seen_counts_as_new():
    d = decide(FACTS, manifest({"clicks": {"0": 5}}), {P0: 5, P1: 2}, NOW)

    assert d.run and d.new_records == 2


def test_pending_async_elements_run():
    d = decide(
        FACTS,
        manifest(
            {"clicks": {"0": 5}}, pending={"file": "pending/00000000000000000001.arrow", "count": 4}
        ),
        {P0: 5},
        NOW,
    )

    assert d.run and "4 async elements pending" in d.reason


def test_nothing_new_with_active_partitions_is_idle():
    m = manifest({"clicks": {"0": 5}}, event_time=active_partitions(last_seen_ms=NOW - 1_000))

    d = decide(FACTS, m, {P0: 5}, NOW)

    assert not d.run and d.event()["status"] == "idle"


def test_nothing_new_but_partitions_went_idle_runs_because_timers_may_fire():
    m = manifest({"clicks": {"0": 5}}, event_time=active_partitions(last_seen_ms=NOW - 60_000))

    d = decide(FACTS, m, {P0: 5}, NOW)

    assert d.run and "watermark would advance from -59000 to -55000" in d.reason


def test_once_the_watermark_has_caught_up_idle_batches_are_skipped():
    et = active_partitions(last_seen_ms=NOW - 60_000) | {"watermark": 5_000 - 60_000}

    assert not decide(FACTS, manifest({"clicks": {"0": 5}}, event_time=et), {P0: 5}, NOW).run


def test_a_pipeline_without_event_time_never_runs_for_timers():
    facts = PipelineFacts("clicks", "file:///tmp/x", ("clicks",))
    m = manifest({"clicks": {"0": 5}}, event_time=active_partitions(last_seen_ms=0))

    assert not decide(facts, m, {P0: 5}, NOW).run
