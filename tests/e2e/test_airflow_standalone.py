"""Airflow as a user runs it: ``airflow standalone`` on the real stack (Kafka, SeaweedFS,
Spark), driven through its REST API v2 and, in headless Chromium, through its own login
page, the Microbatch page and the DAG's grid.

One ``airflow standalone`` per module (see :func:`standalone`); one manual ``clickstream``
run with an explicit data interval at parallelism 3 (:func:`smoke_run`) feeds the tests.
"""

from __future__ import annotations

import datetime as dt
import json
import shutil
import time
import uuid
from pathlib import Path
from urllib.parse import quote

import pytest

from microbatch.checkpoint import Layout, list_checkpoints, load_manifest
from microbatch.examples.clickstream import ClickstreamConfig
from microbatch.examples.profile_service import ProfileService
from microbatch.localstack.airflow import AirflowStandalone
from microbatch.localstack.process import free_port_block
from microbatch.localstack.topics import create_topics
from microbatch.storage import open_store
from tests.e2e.conftest import REPO, StandaloneAirflow, airflow_env, parse_time, utcnow

# The first test also starts Airflow and waits for its first scheduled run: more than the
# suite's 10 minutes per test on a loaded 2-core machine would be possible.
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1200)]

DAG_ID = "clickstream"
LIVE_DAG_ID = "clickstream_live"
LIVE_DAG = """
from microbatch_airflow.dag_factory import microbatch_dag

microbatch_dag({dag_id!r}, {job!r}, pipeline={dag_id!r}, schedule="on_new_data",
               new_data_poll_s=1.0, max_parallelism=64, default_parallelism=2,
               env={env!r}, retries=0)
"""
USERNAME = "admin"
HOUR = dt.timedelta(hours=1)


def history_clicks(start: dt.datetime, end: dt.datetime) -> list[dict]:
    """Clicks of users ``hist-*`` every few minutes in ``[start, end)``, in time order, with
    pauses of over 30 minutes so that sessions close."""
    import random

    rng = random.Random(11)
    pages = ("/home", "/search", "/item", "/cart")
    clicks, ms = [], int(start.timestamp() * 1000)
    while ms < int(end.timestamp() * 1000):
        clicks.append({"user_id": f"hist-{rng.randrange(6)}", "page": rng.choice(pages), "ts": ms})
        ms += rng.choices((30_000, 60_000, 120_000, 2_400_000), weights=(4, 4, 3, 1))[0]
    return clicks


@pytest.fixture(scope="module")
def standalone(stack_settings, new_airflow_home):
    """A running ``airflow standalone`` (a :class:`StandaloneAirflow`) on the test stack.

    Started with: a fresh ``AIRFLOW_HOME`` under the test's tmp folder with a metadata
    database of its own on the run's PostgreSQL (``new_airflow_home``); the API on a free
    port of 127.0.0.1; the repo's ``dags/`` and ``plugins/``; the venv's ``bin`` on
    ``PATH``, ``PYSPARK_PYTHON``; the stack's ``MICROBATCH_*`` settings and a fresh
    clickstream namespace (topics ``clicks-sa-<id>`` …, root
    ``s3://<bucket>/e2e-standalone-<id>``, ``MICROBATCH_CLICKSTREAM_*``, idle timeout
    600 s so idle partitions never trigger a batch by themselves) with its profile service;
    the simple auth manager's user ``admin`` with a known password (a passwords file via
    ``[core] simple_auth_manager_passwords_file``). The topics exist before Airflow starts;
    ``clickstream`` is unpaused and settled (the scheduled run the unpause creates has
    ended) before the fixture returns.

    What a test gets: ``url``; ``username``/``password``; ``token()`` (JWT); ``api(method,
    path, body)``; ``env`` and ``cli(*args)`` to run ``airflow ...`` (e.g. ``airflow
    backfill create``) against the same instance and database; ``config``
    (:class:`ClickstreamConfig`); ``settings``; ``bootstrap``; ``clicks_between(start,
    end)`` and ``produce_clicks(clicks)`` (Kafka timestamp = the click's ``ts``);
    ``settle()`` (waits for the active runs to end), ``trigger(...)``,
    ``wait_for_run(run_id)``, ``task_log(...)``.

    The clickstream DAG ticks at 00 past the four hours of history only (``history_hour``
    - 4 h .. - 1 h, UTC): unpaused, it runs the last of those intervals once (catch-up is
    off) and its next tick is at least 20 hours away. No scheduled run can interleave with
    the tests' own runs, and no test waits for the clock. The whole process group is
    stopped at the end.

    Beside the repo's DAGs (linked into a DAG folder of the test's own), the folder holds
    ``clickstream_live``: the clickstream job on a namespace of its own
    (``live_config``), scheduled ``on_new_data``; it stays paused until a test unpauses it.
    """
    run = uuid.uuid4().hex[:8]
    airflow_home = new_airflow_home("standalone")
    home = airflow_home.path
    profiles = ProfileService(1, 0.0, home / "profiles.log")
    config = ClickstreamConfig.fresh(
        stack_settings.s3_bucket,
        "e2e-standalone",
        f"sa-{run}",
        profile_url=profiles.url,
        idle_timeout_s=600.0,
    )
    live = ClickstreamConfig.fresh(
        stack_settings.s3_bucket, "e2e-live", f"live-{run}", profile_url=profiles.url,
        idle_timeout_s=600.0,
    )  # fmt: skip
    for c in (config, live):
        topics = {c.topic: 2, c.sessions_topic: 1, c.dead_letter_topic: 1}
        create_topics(stack_settings.kafka_bootstrap_servers, topics)
    dags = home / "dags"
    dags.mkdir()
    for dag_file in (REPO / "dags").glob("*.py"):
        (dags / dag_file.name).symlink_to(dag_file)
    job = str(REPO / "jobs" / "clickstream.py")
    (dags / f"{LIVE_DAG_ID}.py").write_text(
        LIVE_DAG.format(dag_id=LIVE_DAG_ID, job=job, env=live.to_env())
    )
    password = f"pw-{uuid.uuid4().hex}"
    passwords = home / "passwords.json"
    passwords.write_text(json.dumps({USERNAME: password}))
    history_hour = utcnow().replace(minute=0, second=0, microsecond=0)
    ticks = ",".join(str((history_hour - k * HOUR).hour) for k in (4, 3, 2, 1))
    env = airflow_env(
        airflow_home,
        stack_settings.to_env()
        | config.to_env()
        | {
            # The backfill test reprocesses three hourly intervals of history.
            "MICROBATCH_CLICKSTREAM_SCHEDULE": f"0 {ticks} * * *",
            "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": f"{USERNAME}:admin",
            "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE": str(passwords),
            "AIRFLOW__CORE__DAGS_FOLDER": str(dags),
        },
    )
    airflow = AirflowStandalone(home, free_port_block([0]), env)
    sa = StandaloneAirflow(
        airflow, username=USERNAME, password=password, config=config, settings=stack_settings
    )
    sa.live_config = live
    # Three hours of history before the DAG's first run: the backfill test reprocesses it.
    sa.history_hour = history_hour
    sa.history = history_clicks(sa.history_hour - 4 * HOUR, sa.history_hour - HOUR)
    sa.produce_clicks(sa.history)
    try:
        airflow.start()
        airflow.unpause(DAG_ID, sa.token())
        sa.settle(DAG_ID)
        yield sa
    finally:
        airflow.stop()
        profiles.stop()


@pytest.fixture(scope="module")
def smoke_run(standalone):
    """A manual run of ``clickstream`` at parallelism 3 whose data interval continues the
    scheduled ones: from the end of the last scheduled interval (where the pipeline is, an
    hour or more ago) to a second ago, with 80 clicks of that interval in Kafka. Its
    logical date is the interval's end, between two ticks: no scheduled run has it (a run
    at a tick would make the scheduler skip that tick, warning in a loop until the next
    one)."""
    standalone.settle(DAG_ID)
    dag = standalone.api("GET", f"/api/v2/dags/{DAG_ID}")
    start = parse_time(dag["next_dagrun_data_interval_start"])
    end = utcnow().replace(microsecond=0) - dt.timedelta(seconds=1)
    assert (end - start).total_seconds() >= 20, f"no room for clicks in [{start}, {end})"
    clicks = standalone.clicks_between(start, end, count=80, users=15, seed=5)
    standalone.produce_clicks(clicks)
    run = standalone.trigger(
        DAG_ID, conf={"parallelism": 3}, start=start, end=end, logical_date=end
    )
    final = standalone.wait_for_run(run["dag_run_id"], DAG_ID, timeout=900)
    xcom = standalone.api(
        "GET",
        f"/api/v2/dags/{DAG_ID}/dagRuns/{quote(run['dag_run_id'], safe='')}/taskInstances/"
        "batch/xcomEntries/return_value?deserialize=true",
    )["value"]
    return {"run": final, "xcom": xcom, "clicks": clicks, "start": start, "end": end}


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


@pytest.fixture(scope="module")
def chrome(tmp_path_factory):
    """Debian's headless Chromium through its chromedriver (installed by ``make browser``)."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    browser, driver = shutil.which("chromium"), shutil.which("chromedriver")
    assert browser and driver, "chromium/chromedriver not on PATH: run `make browser`"
    options = webdriver.ChromeOptions()
    options.binary_location = browser
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1400,1000",
                f"--user-data-dir={tmp_path_factory.mktemp('chromium')}"):  # fmt: skip
        options.add_argument(arg)
    session = webdriver.Chrome(options=options, service=Service(driver))
    yield session
    session.quit()


def _screenshot(chrome, tmp_path: Path, name: str) -> Path:
    path = tmp_path / f"{name}.png"
    assert chrome.save_screenshot(str(path)), f"no screenshot written to {path}"
    print(f"screenshot: {path}")
    return path


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
    _screenshot(chrome, tmp_path, "1-login")
    chrome.find_element(By.CSS_SELECTOR, "button[type=submit]").click()
    wait.until(ec.url_to_be(f"{standalone.url}/microbatch/"))

    section = wait.until(ec.presence_of_element_located((By.ID, DAG_ID)))
    assert section.tag_name == "h2"
    summary = chrome.find_element(By.XPATH, f"//h2[@id='{DAG_ID}']/following-sibling::p[2]")
    _screenshot(chrome, tmp_path, "2-microbatch-page")
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
    assert chrome.find_element(By.ID, f"grid-{run_id}-new_data")
    _screenshot(chrome, tmp_path, "3-dag-grid")

    chrome.get(f"{standalone.url}/dags/{DAG_ID}/runs/{quote(run_id, safe='')}")
    state = (By.CSS_SELECTOR, "[data-testid=state-badge]")
    wait.until(ec.text_to_be_present_in_element(state, "Success"))
    assert chrome.find_element(By.ID, f"grid-{run_id}-batch")
    assert run_id in chrome.find_element(By.TAG_NAME, "body").text
    _screenshot(chrome, tmp_path, "4-dag-run")


def _backfill(standalone, start: dt.datetime, end: dt.datetime) -> list[dict]:
    """``airflow backfill create`` over the intervals starting at ``start``..``end``, as a
    user types it; waits for the backfill to complete. The batch results, in order."""
    standalone.settle(DAG_ID)
    created = standalone.cli(
        "backfill", "create", "--dag-id", DAG_ID, "--from-date", start.isoformat(),
        "--to-date", end.isoformat(), "--reprocess-behavior", "completed",
    )  # fmt: skip
    assert created.returncode == 0, created.stdout[-2000:] + created.stderr[-3000:]
    backfills = standalone.api("GET", f"/api/v2/backfills?dag_id={DAG_ID}")["backfills"]
    backfill = max(backfills, key=lambda b: b["id"])
    deadline = time.monotonic() + 1200
    while backfill["completed_at"] is None:
        assert time.monotonic() < deadline, f"backfill {backfill} did not complete"
        time.sleep(5)
        backfill = standalone.api("GET", f"/api/v2/backfills/{backfill['id']}")
    runs = standalone.api(
        "GET",
        f"/api/v2/dags/{DAG_ID}/dagRuns?run_type=backfill&order_by=logical_date"
        f"&logical_date_gte={quote(start.isoformat())}&logical_date_lte={quote(end.isoformat())}",
    )["dag_runs"]
    assert [parse_time(r["logical_date"]) for r in runs] == [start, start + HOUR, end]
    results = []
    for run in runs:
        final = standalone.wait_for_run(run["dag_run_id"], DAG_ID, timeout=60)
        assert final["state"] == "success"
        results.append(
            standalone.api(
                "GET",
                f"/api/v2/dags/{DAG_ID}/dagRuns/{quote(run['dag_run_id'], safe='')}/"
                "taskInstances/batch/xcomEntries/return_value?deserialize=true",
            )["value"]
        )
    return results


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
        states = [(r["run_id"], r["state"]) for r in runs]
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
