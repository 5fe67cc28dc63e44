"""The one line a batch leaves in its log (the CLI's progress, the Airflow task log)."""

from __future__ import annotations

from microbatch.cli import _run_line

RESULT = {
    "pipeline": "clickstream", "batch_id": 5, "parallelism": 2, "status": "committed",
    "replayed": False, "records_in": 17, "dead_letters": 0, "dead_letter_reasons": {},
    "outputs": {"sessions": 6, "sessions_topic": 6}, "watermark": 1795686720000,
    "lag": {"clicks[0]": 0}, "ranges": [], "recovered_publish": None, "rewind": None,
    "seconds": {"plan": 0.2, "total": 3.24},
}  # fmt: skip


def test_a_plain_batch_reads_as_one_sentence():
    assert _run_line(RESULT) == (
        "batch 5 committed in 3.2 s: 17 records in, 0 dead letters, out sessions=6 "
        "sessions_topic=6, watermark 2026-11-26T09:52:00+00:00, parallelism 2"
    )


def test_dead_letters_replays_and_rewinds_are_named():
    line = _run_line(RESULT | {
        "dead_letters": 1, "dead_letter_reasons": {"malformed": 1}, "replayed": True,
        "rewind": {"to_checkpoint": 2, "undone": [3, 5], "checkpoint": 6},
        "recovered_publish": 4,
    })  # fmt: skip

    assert "1 dead letter (malformed 1)" in line
    assert "replayed the stored plan of an earlier attempt" in line
    assert "rewound to checkpoint 2 (undid 3..5)" in line
    assert "published checkpoint 4 first" in line
    assert "\n" not in line


def test_a_dry_run_without_outputs_or_watermark_still_reads():
    line = _run_line(RESULT | {"status": "dry_run", "outputs": {}, "watermark": None,
                               "records_in": 0, "seconds": {}})  # fmt: skip

    assert line.startswith("batch 5 dry_run in 0.0 s: 0 records in")
    assert "out none" in line and "watermark -" in line
