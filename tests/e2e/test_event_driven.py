"""Event-driven runs on the real stack: ``clickstream_live`` (the clickstream job on a
namespace of its own, ``schedule="on_new_data"``) in the run's ``airflow standalone``:
records arriving start runs through the asset watcher, each record is read once, and a
duplicated event starts a run that writes nothing."""

from __future__ import annotations

import datetime as dt
import time
from urllib.parse import quote

import pytest

from tests.e2e.harness import utcnow
from tests.e2e.standalone import HOUR, LIVE_DAG_ID, history_clicks

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]


def _runs(standalone, dag_id: str) -> list[dict]:
    return standalone.api("GET", f"/api/v2/dags/{dag_id}/dagRuns?order_by=run_after&limit=100")[
        "dag_runs"
    ]


def _wait_for_runs(standalone, dag_id: str, count: int, timeout: float = 300.0) -> list[dict]:
    """The DAG's runs once at least ``count`` exist and all have ended."""
    deadline = time.monotonic() + timeout
    while True:
        runs = _runs(standalone, dag_id)
        if len(runs) >= count and all(r["state"] in ("success", "failed") for r in runs):
            return runs
        states = [(r["dag_run_id"], r["state"]) for r in runs]
        assert time.monotonic() < deadline, f"{dag_id}: fewer than {count} ended runs: {states}"
        time.sleep(1)


def _batch_result(standalone, dag_id: str, run: dict) -> dict | None:
    """The batch task's result, or None when its batch was skipped (nothing new)."""
    tis = standalone.task_instances(run["dag_run_id"], dag_id)
    assert tis["new_data"]["state"] in ("success", "skipped"), tis
    if tis["batch"]["state"] == "skipped":
        return None
    assert tis["batch"]["state"] == "success", tis
    return standalone.api(
        "GET",
        f"/api/v2/dags/{dag_id}/dagRuns/{quote(run['dag_run_id'], safe='')}/taskInstances/"
        "batch/xcomEntries/return_value?deserialize=true",
    )["value"]


def _batch_results(standalone, dag_id: str, runs: list[dict]) -> list[dict]:
    return [r for run in runs if (r := _batch_result(standalone, dag_id, run)) is not None]


def test_event_driven_runs_commit_new_records_once_and_a_duplicate_event_adds_nothing(
    standalone,
):
    from microbatch.examples.clickstream import reference_sessions
    from microbatch.sinks import parquet as ps

    live = standalone.live_config
    standalone.airflow.unpause(LIVE_DAG_ID, standalone.token())
    # Airflow starts an unpaused DAG's asset watchers when it next parses the DAG's file
    # (every 30 s by default): ask for that parse now, as the UI's "Reparse DAG" does.
    file_token = standalone.api("GET", f"/api/v2/dags/{LIVE_DAG_ID}")["file_token"]
    standalone.api("PUT", f"/api/v2/parseDagFile/{file_token}")
    # No checkpoint yet: the watcher fires at once and the first run sets the pipeline up.
    first = _wait_for_runs(standalone, LIVE_DAG_ID, 1)
    assert {r["run_type"] for r in first} == {"asset_triggered"}

    # Two hours of clicks, with pauses that close sessions, arrive now: no run is asked for.
    now = utcnow().replace(microsecond=0)
    clicks = history_clicks(now - 2 * HOUR, now - dt.timedelta(minutes=1))
    produced = time.monotonic()
    standalone.produce_clicks(clicks, topic=live.topic)
    while True:
        runs = _wait_for_runs(standalone, LIVE_DAG_ID, len(first) + 1)
        results = _batch_results(standalone, LIVE_DAG_ID, runs)
        if sum(r["records_in"] for r in results) >= len(clicks):
            break
        assert time.monotonic() - produced < 300, f"the clicks were not all read: {results}"
        time.sleep(1)
    print(f"produced → committed by event-driven runs in {time.monotonic() - produced:.1f} s")
    assert sum(r["records_in"] for r in results) == len(clicks)
    assert {r["run_type"] for r in runs} == {"asset_triggered"}

    # A duplicate of the watcher's event (what an at-least-once trigger may send).
    assets = standalone.api("GET", "/api/v2/assets?uri_pattern=new-records")["assets"]
    watched = next(a for a in assets if a["name"] == f"microbatch.{LIVE_DAG_ID}.new_records")
    standalone.api("POST", "/api/v2/assets/events", {"asset_id": watched["id"]})
    after = _wait_for_runs(standalone, LIVE_DAG_ID, len(runs) + 1)
    assert [_batch_result(standalone, LIVE_DAG_ID, r) for r in after[len(runs) :]] == [None] * (
        len(after) - len(runs)
    ), "a run after every record was read still ran a batch"
    assert _batch_results(standalone, LIVE_DAG_ID, after) == results

    # Every closed session once, as plain Python computes it.
    sessions = ps.read_parquet_sink(f"{live.root}/sessions", standalone.settings).to_pylist()
    seen = sorted((r["user_id"], r["session_start"]) for r in sessions)
    assert len(seen) == len(set(seen)), "a session is visible twice"
    closed = reference_sessions(clicks, results[-1]["watermark"])
    assert closed and seen == sorted((r["user_id"], r["session_start"]) for r in closed)
