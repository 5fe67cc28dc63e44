"""The one ``airflow standalone`` of the e2e run and what its tests share: a manual run of
the clickstream DAG, a headless Chromium. Session-scoped, imported by ``conftest.py``:
the standalone tests, the event-driven test and the in-frame page test all use the same
instance (starting one costs about a minute)."""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
import shutil
import signal
import subprocess
import uuid
from pathlib import Path
from urllib.parse import quote

import pytest

from microbatch.examples.clickstream import ClickstreamConfig
from microbatch.examples.profile_service import ProfileService
from microbatch.localstack.airflow import AirflowStandalone
from microbatch.localstack.topics import create_topics
from tests.e2e.harness import REPO, StandaloneAirflow, airflow_env, parse_time, utcnow

DAG_ID = "clickstream"
LIVE_DAG_ID = "clickstream_live"
FAILOVER_DAG_ID = "clickstream_failover"
EXTRA_DAG = """
from microbatch_airflow.dag_factory import microbatch_dag

microbatch_dag({dag_id!r}, {job!r}, pipeline={dag_id!r}, schedule={schedule!r},
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


@pytest.fixture(scope="session")
def standalone(stack_settings, new_airflow_home, spark_connect):
    """A running ``airflow standalone`` (a :class:`StandaloneAirflow`) on the test stack.

    Started with: a fresh ``AIRFLOW_HOME`` under the test's tmp folder with a metadata
    database of its own on the run's PostgreSQL (``new_airflow_home``); batches on the
    run's warm Spark Connect server (``spark_connect``), as ``make airflow`` runs them; the
    API on a free port of 127.0.0.1; the repo's ``dags/`` and ``plugins/``; the venv's
    ``bin`` on ``PATH``, ``PYSPARK_PYTHON``; the stack's ``MICROBATCH_*`` settings and a fresh
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
    two more DAGs of the clickstream job, each on a namespace of its own:
    ``clickstream_live`` (``live_config``), scheduled ``on_new_data``, and
    ``clickstream_failover`` (``failover_config``), manual runs only; both stay paused until
    a test unpauses them. Processes a test starts to stand in for the instance's own
    (``replacement_processes``: a second scheduler) are stopped with it.
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
    live, failover = (
        ClickstreamConfig.fresh(stack_settings.s3_bucket, f"e2e-{label}", f"{label}-{run}",
                                profile_url=profiles.url, idle_timeout_s=600.0)
        for label in ("live", "failover")
    )  # fmt: skip
    for c in (config, live, failover):
        topics = {c.topic: 2, c.sessions_topic: 1, c.dead_letter_topic: 1}
        create_topics(stack_settings.kafka_bootstrap_servers, topics)
    dags = home / "dags"
    dags.mkdir()
    for dag_file in (REPO / "dags").glob("*.py"):
        (dags / dag_file.name).symlink_to(dag_file)
    job = str(REPO / "jobs" / "clickstream.py")
    for dag_id, schedule, c in ((LIVE_DAG_ID, "on_new_data", live),
                                (FAILOVER_DAG_ID, None, failover)):  # fmt: skip
        text = EXTRA_DAG.format(dag_id=dag_id, job=job, schedule=schedule, env=c.to_env())
        (dags / f"{dag_id}.py").write_text(text)
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
            # Warm, as `make airflow` runs them: the batches run on the run's Connect server.
            "MICROBATCH_SPARK_MASTER": spark_connect.url,
        },
    )
    airflow = AirflowStandalone(home, None, env)
    sa = StandaloneAirflow(
        airflow, username=USERNAME, password=password, config=config, settings=stack_settings
    )
    sa.live_config, sa.failover_config = live, failover
    sa.replacement_processes = []
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
        for process in sa.replacement_processes:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=30)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
        airflow.stop()
        profiles.stop()


@pytest.fixture(scope="session")
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


@pytest.fixture(scope="session")
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


def screenshot(chrome, tmp_path: Path, name: str) -> Path:
    path = tmp_path / f"{name}.png"
    assert chrome.save_screenshot(str(path)), f"no screenshot written to {path}"
    print(f"screenshot: {path}")
    return path
