"""What the e2e tests drive Airflow with: an ``AIRFLOW_HOME`` with its own metadata
database (:class:`AirflowHome`), the environment of an Airflow subprocess
(:func:`airflow_env`), a script run in a fresh interpreter (:func:`run_airflow_script`),
and a running ``airflow standalone`` seen through its REST API (:class:`StandaloneAirflow`).
Airflow runs in subprocesses, so its config never leaks into the pytest process."""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any
from urllib.parse import quote

REPO = Path(__file__).resolve().parents[2]
#: The start of a script that serves Airflow's API app in-process (``TestClient``): DAGs
#: parsed and synced to the database like the DAG processor does, every asset's id in
#: ``ids`` (by URI), and ``errors`` holding the import errors.
API_APP_PRELUDE = """
import json
from sqlalchemy import select
from airflow.api_fastapi.app import create_app, get_auth_manager
from airflow.api_fastapi.auth.managers.simple.user import SimpleAuthManagerUser
from airflow.dag_processing.bundles.manager import DagBundlesManager
from airflow.dag_processing.dagbag import BundleDagBag, sync_bag_to_db
from airflow.models.asset import AssetEvent, AssetModel
from airflow.utils.session import create_session
from fastapi.testclient import TestClient

manager = DagBundlesManager()
with create_session() as session:
    manager.sync_bundles_to_db(session=session)
errors = {}
for bundle in manager.get_all_dag_bundles():
    bundle.initialize()
    bag = BundleDagBag(dag_folder=bundle.path, bundle_path=bundle.path, bundle_name=bundle.name)
    errors |= bag.import_errors
    sync_bag_to_db(bag, bundle.name, bundle.version)
with create_session() as session:
    ids = {uri: i for i, uri in session.execute(select(AssetModel.id, AssetModel.uri))}
"""
VENV_BIN = Path(sys.executable).parent


@dataclasses.dataclass(frozen=True)
class AirflowHome:
    """An ``AIRFLOW_HOME`` folder and its own metadata database on the run's PostgreSQL."""

    path: Path
    database: dict[str, str]  # the AIRFLOW__DATABASE__* variables naming it


def airflow_env(home: AirflowHome, extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        {
            "AIRFLOW_HOME": str(home.path),
            "AIRFLOW__CORE__DAGS_FOLDER": str(REPO / "dags"),
            "AIRFLOW__CORE__PLUGINS_FOLDER": str(REPO / "plugins"),
            "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
            "AIRFLOW__CORE__UNIT_TEST_MODE": "False",
            "PATH": f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}",
            "PYSPARK_PYTHON": sys.executable,
        }
        | home.database
    )
    env.update(extra or {})
    return env


def run_airflow_script(home: AirflowHome, code: str, extra_env: dict[str, str] | None = None):
    """Run Python ``code`` in a fresh interpreter configured for ``home``."""
    return subprocess.run(
        [sys.executable, "-c", code],
        env=airflow_env(home, extra_env),
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
        cwd=REPO,
    )


class StandaloneAirflow:
    """A running ``airflow standalone`` seen as a user sees it: REST API v2, the ``airflow``
    CLI, and the Kafka topic its clickstream DAG reads (see the module fixture
    ``standalone`` of ``test_airflow_standalone.py`` for what it is started with).

    - ``url``, ``username``/``password`` (the admin login), ``token()`` (a JWT from
      ``POST /auth/token``), ``api(method, path, body)`` (decoded JSON, or raises
      :class:`~microbatch.localstack.airflow.AirflowAPIError` with the status);
    - ``env``: the environment of the instance, to run ``airflow`` commands against it
      (``cli("backfill", "create", ...)``);
    - ``config`` (:class:`ClickstreamConfig`, a fresh namespace), ``settings``
      (:class:`Settings` of the stack), ``bootstrap`` (Kafka);
    - ``clicks_between(start, end)`` and ``produce_clicks(clicks)``: clicks whose Kafka
      record timestamp is their ``ts``, so a run whose data interval ends after them reads
      them;
    - ``settle()``, ``trigger(...)``, ``wait_for_run(run_id)``, ``task_log(...)``.
    """

    def __init__(self, airflow, *, username, password, config, settings) -> None:
        self.airflow = airflow
        self.username = username
        self.password = password
        self.config = config
        self.settings = settings
        self._token: tuple[float, str] | None = None

    @property
    def url(self) -> str:
        return self.airflow.url

    @property
    def env(self) -> dict[str, str]:
        return dict(self.airflow.env)

    @property
    def bootstrap(self) -> str:
        return self.settings.kafka_bootstrap_servers

    def token(self) -> str:
        """A JWT for the REST API, renewed every 10 minutes."""
        if self._token is None or time.monotonic() - self._token[0] > 600:
            self._token = (time.monotonic(), self.airflow.token(self.username, self.password))
        return self._token[1]

    def api(self, method: str, path: str, body: Any = None, **kwargs: Any) -> Any:
        return self.airflow.request(method, path, body, token=self.token(), **kwargs)

    def cli(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
        """``airflow <args>`` against this instance (its AIRFLOW_HOME and database)."""
        return subprocess.run(
            [str(VENV_BIN / "airflow"), *args],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
            cwd=REPO,
        )

    # ---- data --------------------------------------------------------------------------

    @staticmethod
    def clicks_between(
        start: dt.datetime, end: dt.datetime, count: int = 60, users: int = 12, seed: int = 7
    ) -> list[dict[str, Any]]:
        """``count`` clicks of ``users`` users at random times in ``[start, end)``, by time."""
        rng = random.Random(seed)
        start_ms, end_ms = _ms(start), _ms(end)
        pages = ("/home", "/search", "/item", "/cart", "/checkout")
        clicks = [
            {"user_id": f"user-{rng.randrange(users):04d}", "page": rng.choice(pages),
             "ts": rng.randrange(start_ms, end_ms)}
            for _ in range(count)
        ]  # fmt: skip
        return sorted(clicks, key=lambda c: (c["ts"], c["user_id"]))

    def produce_clicks(self, clicks: list[dict[str, Any]], topic: str | None = None) -> None:
        """Send ``clicks`` keyed by user, each with Kafka record timestamp = its ``ts``."""
        from kafka import KafkaProducer

        producer = KafkaProducer(bootstrap_servers=self.bootstrap, acks="all", linger_ms=20)
        try:
            for c in clicks:
                producer.send(topic or self.config.topic, key=c["user_id"].encode(),
                              value=json.dumps(c).encode(), timestamp_ms=c["ts"])  # fmt: skip
            producer.flush()
        finally:
            producer.close()

    # ---- runs --------------------------------------------------------------------------

    def settle(self, dag_id: str = "clickstream", timeout=600.0) -> None:
        """Wait until the (unpaused) DAG has no queued or running run, so a run triggered
        now runs first and alone. Its next scheduled run must be over an hour away (the
        test picked a schedule that cannot interfere): settling never waits for the clock.
        """
        deadline = time.monotonic() + timeout
        while True:
            dag = self.api("GET", f"/api/v2/dags/{dag_id}")
            active = self.api(
                "GET", f"/api/v2/dags/{dag_id}/dagRuns?state=queued&state=running&limit=1"
            )["total_entries"]
            next_at = dag.get("next_dagrun_run_after")
            ahead = (parse_time(next_at) - utcnow()).total_seconds() if next_at else 1e9
            # A run that is due (ahead <= 0) is one the scheduler is about to create.
            assert ahead <= 0 or ahead > 3600, (
                f"DAG {dag_id}'s next scheduled run is at {next_at}: its schedule can interleave "
                "with the test's runs; give it one whose ticks are far away"
            )
            if not active and ahead > 0:
                return
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"DAG {dag_id} did not settle in {timeout:.0f} s: {active} active run(s) "
                    f"(paused: {dag.get('is_paused')})"
                )
            time.sleep(1)

    def trigger(
        self, dag_id: str = "clickstream", *, conf: dict[str, Any] | None = None,
        start: dt.datetime | None = None, end: dt.datetime | None = None,
        logical_date: dt.datetime | None = None,
    ) -> dict[str, Any]:  # fmt: skip
        """``POST /dags/{dag_id}/dagRuns`` with an explicit data interval; the new run."""
        body: dict[str, Any] = {"conf": conf or {}, "logical_date": _iso(logical_date)}
        if start is not None or end is not None:
            body |= {"data_interval_start": _iso(start), "data_interval_end": _iso(end)}
        return self.api("POST", f"/api/v2/dags/{dag_id}/dagRuns", body)

    def task_instances(self, run_id: str, dag_id: str = "clickstream") -> dict[str, dict]:
        path = f"/api/v2/dags/{dag_id}/dagRuns/{quote(run_id, safe='')}/taskInstances"
        return {ti["task_id"]: ti for ti in self.api("GET", path)["task_instances"]}

    def task_log(self, run_id: str, task_id: str, try_number: int = 1,
                 dag_id: str = "clickstream") -> str:  # fmt: skip
        path = (f"/api/v2/dags/{dag_id}/dagRuns/{quote(run_id, safe='')}/taskInstances/"
                f"{task_id}/logs/{try_number}?full_content=true")  # fmt: skip
        log = self.api("GET", path)  # JSON: the API refuses text/plain
        content = log.get("content", "")
        if isinstance(content, list):
            content = "\n".join(
                str(e.get("event", e)) if isinstance(e, dict) else str(e) for e in content
            )
        return content

    def wait_for_run(self, run_id: str, dag_id: str = "clickstream", timeout=900.0) -> dict:
        """Wait until the run ends; fail at once, with the task's log tail, when a task
        fails or is up for retry."""
        path = f"/api/v2/dags/{dag_id}/dagRuns/{quote(run_id, safe='')}"
        deadline = time.monotonic() + timeout
        while True:
            run = self.api("GET", path)
            tis = self.task_instances(run_id, dag_id)
            bad = [t for t in tis.values() if t["state"] in ("failed", "up_for_retry")]
            if bad or run["state"] == "failed":
                logs = "\n".join(
                    f"--- {t['task_id']} ({t['state']}), try {t['try_number']}:\n"
                    + self.task_log(run_id, t["task_id"], max(t["try_number"], 1), dag_id)[-4000:]
                    for t in bad
                )
                raise AssertionError(f"run {run_id} of {dag_id}: {run['state']}\n{logs}")
            if run["state"] == "success":
                return run
            if time.monotonic() > deadline:
                states = {t: ti["state"] for t, ti in tis.items()}
                raise AssertionError(f"run {run_id}: still {run['state']} {states} at timeout")
            time.sleep(1)


def utcnow() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def _ms(t: dt.datetime) -> int:
    return int(t.timestamp() * 1000)


def _iso(t: dt.datetime | None) -> str | None:
    return None if t is None else t.astimezone(dt.UTC).isoformat().replace("+00:00", "Z")


def parse_time(text: str) -> dt.datetime:
    return dt.datetime.fromisoformat(text.replace("Z", "+00:00"))
