"""Airflow as a user runs it: ``airflow standalone`` on the real stack (Kafka, SeaweedFS,
Spark), driven through its REST API v2 and, in headless Chromium, through its own login
page, the Microbatch page and the DAG's grid.

The run's one ``airflow standalone`` (:func:`tests.e2e.standalone.standalone`); one manual
``clickstream`` run with an explicit data interval at parallelism 3
(:func:`tests.e2e.standalone.smoke_run`) feeds the tests.
"""

from __future__ import annotations

import datetime as dt
import time
from urllib.parse import quote

import pytest

from microbatch.checkpoint import Layout, list_checkpoints, load_manifest
from microbatch.storage import open_store
from tests.e2e.harness import parse_time
from tests.e2e.standalone import DAG_ID, HOUR, USERNAME, screenshot

# The first test also starts Airflow and waits for its first scheduled run: more than the
# suite's 10 minutes per test on a loaded 2-core machine would be possible.
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1200)]


def test_rest_api_triggered_run_commits_a_batch_at_parallelism_3(standalone, smoke_run):
    run, xcom = smoke_run["run"], smoke_run["xcom"]

    assert run["state"] == "success" and run["run_type"] == "manual"
    assert run["conf"] == {"parallelism": 3}
    assert run["data_interval_start"] == smoke_run["start"].isoformat().replace("+00:00", "Z")
    assert run["data_interval_end"] == smoke_run["end"].isoformat().replace("+00:00", "Z")
    tis = standalone.task_instances(run["dag_run_id"])
    assert {t: ti["state"] for t, ti in tis.items()} == {"new_data": "success", "batch": "success"}

    assert xcom["status"] == "committed" and xcom["parallelism"] == 3
    assert xcom["records_in"] == len(smoke_run["clicks"]) and xcom["dead_letters"] == 0
    assert sum(xcom["lag"].values()) == 0

    store = open_store(f"{standalone.config.root}/checkpoints", standalone.settings)
    assert list_checkpoints(store, Layout())[-1] == xcom["batch_id"]
    manifest = load_manifest(store, Layout(), xcom["batch_id"])
    assert manifest.parallelism == 3 and manifest.max_parallelism == 64
    batch = manifest.metadata["batch"]
    assert batch["run_id"] == f"{DAG_ID}/{run['dag_run_id']}"
    assert batch["interval_start_ms"] == int(smoke_run["start"].timestamp() * 1000)
    assert batch["until_timestamp_ms"] == int(smoke_run["end"].timestamp() * 1000)

    # The `airflow` CLI with the fixture's env sees the same instance.
    listed = standalone.cli("dags", "list-runs", DAG_ID, "--state", "success", "-o", "json")
    assert listed.returncode == 0, listed.stderr[-3000:]
    assert run["dag_run_id"] in listed.stdout


def test_browser_logs_in_and_sees_the_checkpoint_and_the_run(
    standalone, smoke_run, chrome, tmp_path
):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.wait import WebDriverWait

    wait = WebDriverWait(chrome, 60)
    run_id = smoke_run["run"]["dag_run_id"]

    chrome.get(f"{standalone.url}/microbatch/")
    wait.until(ec.url_contains("/auth/login"))
    wait.until(ec.element_to_be_clickable((By.NAME, "username"))).send_keys(USERNAME)
    chrome.find_element(By.NAME, "password").send_keys(standalone.password)
    screenshot(chrome, tmp_path, "1-login")
    chrome.find_element(By.CSS_SELECTOR, "button[type=submit]").click()
    wait.until(ec.url_to_be(f"{standalone.url}/microbatch/"))

    section = wait.until(ec.presence_of_element_located((By.ID, DAG_ID)))
    assert section.tag_name == "h2"
    summary = chrome.find_element(By.XPATH, f"//h2[@id='{DAG_ID}']/following-sibling::p[2]")
    screenshot(chrome, tmp_path, "2-microbatch-page")
    checkpoint_id = summary.find_element(By.TAG_NAME, "b").text
    assert checkpoint_id == str(smoke_run["xcom"]["batch_id"]), summary.text
    assert "parallelism 3 of max 64" in summary.text
    assert summary.find_element(By.CSS_SELECTOR, "span.lag").text == "0"
    rows = chrome.find_elements(
        By.XPATH, "//h3[.='Lag per partition']/following-sibling::table[1]//tr[td]"
    )
    partitions = [[td.text for td in row.find_elements(By.TAG_NAME, "td")] for row in rows]
    topic = standalone.config.topic
    assert [p[0] for p in partitions] == [f"{topic}[0]", f"{topic}[1]"]
    committed = len(smoke_run["clicks"]) + len(standalone.history)
    assert sum(int(p[1]) for p in partitions) == committed
    assert [p[2] for p in partitions] == [p[1] for p in partitions]  # end = committed
    assert f"signed in as {USERNAME}" in chrome.find_element(By.TAG_NAME, "h1").text

    chrome.get(f"{standalone.url}/dags/{DAG_ID}")
    cell = wait.until(ec.presence_of_element_located((By.ID, f"grid-{run_id}-batch")))
    assert cell.get_attribute("href").endswith(f"/dags/{DAG_ID}/runs/{run_id}/tasks/batch")
    assert wait.until(ec.presence_of_element_located((By.ID, f"grid-{run_id}-new_data")))
    screenshot(chrome, tmp_path, "3-dag-grid")

    chrome.get(f"{standalone.url}/dags/{DAG_ID}/runs/{quote(run_id, safe='')}")
    state = (By.CSS_SELECTOR, "[data-testid=state-badge]")
    wait.until(ec.text_to_be_present_in_element(state, "Success"))
    # The run page renders its badge and its grid from separate requests: either may come
    # first, so the grid's cell is waited for too, not looked up once.
    assert wait.until(ec.presence_of_element_located((By.ID, f"grid-{run_id}-batch")))
    assert run_id in chrome.find_element(By.TAG_NAME, "body").text
    screenshot(chrome, tmp_path, "4-dag-run")


def _backfill(standalone, start: dt.datetime, end: dt.datetime) -> list[dict]:
    """``airflow backfill create`` over the intervals starting at ``start``..``end``, as a
    user types it; waits for its runs to succeed. The batch results, in order.

    A DAG has one backfill at a time: an earlier one must first be marked complete, which
    the scheduler does every 30 s once its runs have ended. Waiting for that here rather
    than right after the earlier backfill lets the checks of its output overlap the wait.
    """
    _wait_until_every_backfill_completed(standalone)
    standalone.settle(DAG_ID)
    created = standalone.cli(
        "backfill", "create", "--dag-id", DAG_ID, "--from-date", start.isoformat(),
        "--to-date", end.isoformat(), "--reprocess-behavior", "completed",
    )  # fmt: skip
    assert created.returncode == 0, created.stdout[-2000:] + created.stderr[-3000:]
    # The backfill's runs exist (queued) once the command returns.
    runs = standalone.api(
        "GET",
        f"/api/v2/dags/{DAG_ID}/dagRuns?run_type=backfill&order_by=logical_date"
        f"&logical_date_gte={quote(start.isoformat())}&logical_date_lte={quote(end.isoformat())}",
    )["dag_runs"]
    assert [parse_time(r["logical_date"]) for r in runs] == [start, start + HOUR, end]
    results = []
    for run in runs:
        final = standalone.wait_for_run(run["dag_run_id"], DAG_ID, timeout=1200)
        assert final["state"] == "success"
        results.append(
            standalone.api(
                "GET",
                f"/api/v2/dags/{DAG_ID}/dagRuns/{quote(run['dag_run_id'], safe='')}/"
                "taskInstances/batch/xcomEntries/return_value?deserialize=true",
            )["value"]
        )
    return results


def _wait_until_every_backfill_completed(standalone, timeout: float = 300.0) -> None:
    """Wait until the scheduler has marked every backfill of the DAG completed."""
    deadline = time.monotonic() + timeout
    while True:
        backfills = standalone.api("GET", f"/api/v2/backfills?dag_id={DAG_ID}")["backfills"]
        active = [b for b in backfills if b["completed_at"] is None]
        if not active:
            return
        assert time.monotonic() < deadline, f"backfill(s) {active} did not complete"
        time.sleep(1)


def test_backfill_from_the_cli_reprocesses_three_past_intervals_identically_twice(
    standalone, smoke_run
):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from microbatch.examples.clickstream import reference_sessions
    from microbatch.sinks import parquet as ps

    first = standalone.history_hour - 4 * HOUR  # the intervals [h-4, h-3) .. [h-2, h-1)
    sink = open_store(f"{standalone.config.root}/sessions", standalone.settings)

    def outputs(results: list[dict]) -> tuple[list[bytes], list[dict]]:
        entries = ps.commit_entries(sink)
        visible = ps.visible_batches(entries)
        files = []
        for r in results:
            entry = entries[r["batch_id"]]  # a batch that closed no session has no file
            assert r["status"] == "committed" and (r["batch_id"] in visible or not entry["files"])
            files += [sink.get(key) for key in entry["files"]]
        rows = pa.concat_tables([pq.read_table(pa.BufferReader(f)) for f in files]).to_pylist()
        return files, sorted(rows, key=lambda r: (r["user_id"], r["session_start"]))

    once = _backfill(standalone, first, first + 2 * HOUR)
    # The pipeline had gone past the first interval's start: its first batch covered the
    # whole history (catch-up off), so the backfill starts from before the first batch.
    assert once[0]["rewind"]["to_checkpoint"] is None
    assert [r["rewind"] for r in once[1:]] == [None, None]
    assert sum(r["records_in"] for r in once) == len(standalone.history)
    files, rows = outputs(once)
    closed = reference_sessions(standalone.history, once[-1]["watermark"])
    assert rows == closed and closed  # the plain-Python sessions, each once

    # Every session a reader sees now is a real one, once: the recomputed intervals
    # replaced the first batch's output; later output (the smoke run's) stays.
    everything = ps.read_parquet_sink(f"{standalone.config.root}/sessions", standalone.settings)
    seen = [(r["user_id"], r["session_start"]) for r in everything.to_pylist()]
    assert len(seen) == len(set(seen)), "a session is visible twice"
    every_session = reference_sessions(standalone.history, 2**62)
    assert {(r["user_id"], r["session_start"]) for r in every_session} >= {
        s for s in seen if s[0].startswith("hist-")
    }

    twice = _backfill(standalone, first, first + 2 * HOUR)
    assert twice[0]["rewind"]["to_checkpoint"] is not None  # the copy made by the first
    again_files, again_rows = outputs(twice)
    assert again_rows == rows
    assert again_files == files  # the same rows in the same bytes, file by file
    visible = ps.visible_batches(ps.commit_entries(sink))
    assert not {r["batch_id"] for r in once} & set(visible)  # replaced, not doubled
    assert len(again_files) >= 2  # sessions closed in at least two of the intervals
