"""A committed batch's outputs become asset events under their own URIs."""

from __future__ import annotations

from microbatch_airflow.assets import output_events, output_uri


def test_each_output_with_rows_gets_an_event_under_its_uri() -> None:
    result = {
        "pipeline": "clicks",
        "batch_id": 7,
        "outputs": {"sessions": 12, "delta": 12, "topic": 12, "empty": 0},
        "lineage": {
            "outputs": [
                {"sink": "sessions", "namespace": "file", "name": "/data/sessions"},
                {"sink": "delta", "namespace": "s3://lake", "name": "tables/sessions"},
                {"sink": "topic", "namespace": "kafka://broker:9092", "name": "sessions"},
                {"sink": "empty", "namespace": "s3://lake", "name": "nothing"},
            ]
        },
    }

    events = dict(output_events(result))

    assert set(events) == {
        "file:///data/sessions",
        "s3://lake/tables/sessions",
        "kafka://broker:9092/sessions",
    }
    assert events["s3://lake/tables/sessions"] == {
        "pipeline": "clicks", "batch_id": 7, "sink": "delta", "rows": 12,
    }  # fmt: skip


def test_a_dry_run_or_a_result_without_lineage_has_no_output_events() -> None:
    assert output_events({"outputs": {"x": 3}}) == []
    assert output_uri({"namespace": "file", "name": "/a b"}) == "file:///a b"
