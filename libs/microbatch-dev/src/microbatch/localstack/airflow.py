"""``make airflow``: the local stack plus ``airflow standalone``, until Ctrl-C.

What a new user gets:

1. Kafka and SeaweedFS on their configured ports (a running or external one is used as is),
2. PostgreSQL (``MICROBATCH_POSTGRES_PORT``, default 5433) holding Airflow's metadata in
   its database ``airflow``, as production Airflow runs (on SQLite the scheduler dies
   when a backfill and other writers overlap); an ``AIRFLOW__DATABASE__SQL_ALCHEMY_CONN``
   of your own is used as is,
3. a warm Spark Connect server (``sc://127.0.0.1:15002``) the DAGs' batches run on, unless
   ``MICROBATCH_SPARK_MASTER`` names another engine; a batch that finds it down runs cold
   with ``spark-submit`` and says so,
4. the example's profile service and its topics,
5. ``airflow standalone`` on ``127.0.0.1:$AIRFLOW__API__PORT`` (default 8080),
6. the ``clickstream`` DAG unpaused: event-driven (a batch as soon as clicks arrive) and
   on its 5-minute schedule (``MICROBATCH_CLICKSTREAM_ON_NEW_DATA=false``: the schedule
   only),
7. a background producer of live clicks into the example's topic, so every scheduled
   batch has records to read.

:class:`AirflowStandalone` — start, wait for the REST API, log in, unpause a DAG, stop the
whole process group — is shared with the end-to-end tests. Airflow runs as a subprocess:
this module imports nothing from Airflow.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from microbatch.errors import MicrobatchError, ServiceError
from microbatch.localstack import LocalStack, PostgresServer, stop_on_sigterm
from microbatch.localstack.process import (
    PortTakenError,
    ServiceProcess,
    free_port_block,
    pid_alive,
    port_is_free,
)
from microbatch.localstack.topics import create_topics
from microbatch.settings import Settings

EXAMPLE_DAG = "clickstream"
PASSWORDS_FILE_VAR = "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE"
DATABASE_VAR = "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"
#: The scheduler's and triggerer's task-log servers (fixed 8793, 8794 by default).
LOG_SERVER_PORT_VARS = (
    "AIRFLOW__LOGGING__WORKER_LOG_SERVER_PORT",
    "AIRFLOW__LOGGING__TRIGGER_LOG_SERVER_PORT",
)
#: The database of Airflow's metadata on the local stack's PostgreSQL.
AIRFLOW_DATABASE = "airflow"


class AirflowAPIError(ServiceError):
    """Airflow's REST API answered an HTTP error; ``status`` is its code."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


class AirflowStandalone:
    """``airflow standalone`` (scheduler, DAG processor, triggerer, API server) as one
    detached process group serving ``http://127.0.0.1:<port>``.

    ``env`` is the whole environment of the process (the ``airflow`` executable must be on
    its ``PATH``); ``AIRFLOW_HOME``, the API host and port are set from the arguments.
    The log is ``<home>/standalone.log``. :meth:`stop` ends every process of the group,
    tasks included. The REST helpers raise :class:`AirflowAPIError` with Airflow's answer.
    """

    def __init__(self, home: Path, port: int | None, env: Mapping[str, str]) -> None:
        self.home = Path(home)
        database = env.get(DATABASE_VAR, "")
        if not database or database.startswith("sqlite"):
            raise ServiceError(
                f"Airflow: {DATABASE_VAR}={database!r}: give airflow standalone a PostgreSQL "
                "database (on SQLite its scheduler dies when a backfill and other writers "
                "overlap); the local stack's: PostgresServer.airflow_env(...)"
            )
        self.env = dict(env) | {"AIRFLOW_HOME": str(self.home), "AIRFLOW__API__HOST": "127.0.0.1"}
        #: ``port=None``: a free port of ours, picked again should another process take it
        #: before the API server binds it. A port the user gave is never changed.
        self.picks_ports = port is None
        self._bound_url = "AIRFLOW__API__BASE_URL" not in self.env
        self._log_ports = [var for var in LOG_SERVER_PORT_VARS if var not in self.env]
        self._use_ports(free_port_block([0]) if port is None else port)
        self.process = ServiceProcess("standalone", self.home)

    def _use_ports(self, port: int) -> None:
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.env["AIRFLOW__API__PORT"] = str(port)
        # Task processes reach the Execution API at ``{base_url}/execution/``; Airflow's
        # default base URL is http://localhost:8080, wrong on any other port.
        if self._bound_url:
            self.env["AIRFLOW__API__BASE_URL"] = self.url
        # The scheduler and triggerer serve task logs on fixed ports (8793, 8794) by
        # default: free ones let two instances (``make airflow`` and the tests) coexist.
        for var in self._log_ports:
            self.env[var] = str(free_port_block([0]))

    @property
    def log_path(self) -> Path:
        return self.process.log_path

    def start(self, timeout: float = 300.0, attempts: int = 3) -> int:
        """Start and wait until ``/api/v2/version`` answers; returns the pid.

        A port taken between our check and the server's bind fails the start at once
        (not after ``timeout``); with ports of our own picking, up to ``attempts`` starts
        run on fresh ones.
        """
        for attempt in range(1, attempts + 1):
            if not port_is_free(self.port):
                if self.picks_ports:
                    self._use_ports(free_port_block([0]))
                    continue
                raise ServiceError(
                    f"Airflow: port {self.port} on 127.0.0.1 is in use. Stop the other "
                    "process, or set AIRFLOW__API__PORT to a free port."
                )
            try:
                return self.process.start(
                    ["airflow", "standalone"],
                    env=self.env,
                    ready=self._api_answers,
                    timeout=timeout,
                    hint="Is the venv's bin on PATH and AIRFLOW_HOME writable?",
                    port_taken_marks=("Address already in use", "address already in use"),
                )
            except PortTakenError:
                self.stop()
                if not self.picks_ports or attempt == attempts:
                    raise
                self._use_ports(free_port_block([0]))
        raise ServiceError(f"Airflow: no free port found in {attempts} attempts")

    def _api_answers(self) -> bool:
        with urllib.request.urlopen(f"{self.url}/api/v2/version", timeout=2) as resp:
            return resp.status == 200

    def wait(self) -> int:
        """Block until the process exits; its exit code (0 if it was not our child)."""
        pid = self.process.pid()
        if pid is None:
            return 0
        try:
            _, status = os.waitpid(pid, 0)
        except ChildProcessError:
            while pid_alive(pid):
                time.sleep(1)
            return 0
        return os.waitstatus_to_exitcode(status)

    def stop(self, timeout: float = 30.0) -> bool:
        """SIGTERM the process group, then wait until every member is gone (SIGKILL
        after ``timeout``). True if something ran."""
        pgid = self.process.pid()
        ran = self.process.stop(timeout)
        if pgid is not None:
            deadline, killed = time.monotonic() + timeout, False
            while _group_alive(pgid):
                if time.monotonic() > deadline:
                    if killed:  # only unreaped zombies can be left
                        break
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(pgid, signal.SIGKILL)
                    deadline, killed = time.monotonic() + 10, True
                time.sleep(0.2)
        return ran

    # ---- users and the REST API ----------------------------------------------------------

    def passwords_file(self) -> Path:
        """The simple auth manager's passwords (``[core] simple_auth_manager_passwords_file``
        when set through the environment, else Airflow's default in the home)."""
        configured = self.env.get(PASSWORDS_FILE_VAR)
        default = self.home / "simple_auth_manager_passwords.json.generated"
        return Path(configured) if configured else default

    def password(self, username: str = "admin", timeout: float = 30.0) -> str:
        """The simple auth manager's password of ``username`` (generated at first start)."""
        path = self.passwords_file()
        deadline = time.monotonic() + timeout
        while True:
            with contextlib.suppress(FileNotFoundError, ValueError):
                passwords = json.loads(path.read_text())
                if username in passwords:
                    return passwords[username]
            if time.monotonic() > deadline:
                raise ServiceError(f"Airflow: no password for {username!r} in {path}")
            time.sleep(0.5)

    def token(self, username: str = "admin", password: str | None = None) -> str:
        """A JWT for the REST API (``POST /auth/token``)."""
        body = {"username": username, "password": password or self.password(username)}
        return self.request("POST", "/auth/token", body)["access_token"]

    def request(
        self, method: str, path: str, body: Any = None, *, token: str | None = None,
        accept: str = "application/json",
    ) -> Any:  # fmt: skip
        """One REST call; the decoded JSON answer (text when ``accept`` is not JSON)."""
        headers = {"Accept": accept}
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        if token:
            headers["Authorization"] = f"Bearer {token}"
        req = urllib.request.Request(self.url + path, data=data, method=method, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=60) as resp:
                raw = resp.read().decode()
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode(errors="replace")[:2000]
            raise AirflowAPIError(
                f"Airflow API {method} {path} answered {exc.code}: {detail}", exc.code
            ) from None
        return json.loads(raw) if "json" in accept and raw else raw

    def wait_for_dag(self, dag_id: str, token: str, timeout: float = 180.0) -> dict[str, Any]:
        """Wait until the DAG processor has parsed ``dag_id``; its ``GET /dags/{id}``."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                return self.request("GET", f"/api/v2/dags/{dag_id}", token=token)
            except AirflowAPIError as exc:
                if exc.status != 404:
                    raise
            if time.monotonic() > deadline:
                errors = self.request("GET", "/api/v2/importErrors", token=token)
                raise ServiceError(
                    f"Airflow: DAG {dag_id!r} not parsed within {timeout:.0f} s; import errors: "
                    f"{json.dumps(errors.get('import_errors', []))[:3000]}"
                )
            time.sleep(1)

    def unpause(self, dag_id: str, token: str) -> None:
        """Unpause ``dag_id`` once it is parsed (DAGs are created paused)."""
        self.wait_for_dag(dag_id, token)
        self.request("PATCH", f"/api/v2/dags/{dag_id}", {"is_paused": False}, token=token)


def _without_password(url: str) -> str:
    """A database URL fit for a terminal: its password replaced by ``***``."""
    head, at, tail = url.rpartition("@")
    if not at or ":" not in head.split("//", 1)[-1]:
        return url
    scheme_user, _, _ = head.rpartition(":")
    return f"{scheme_user}:***@{tail}"


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class LiveClicks:
    """A background producer of live clicks: about ``rate`` per second from ``users``
    users, each record's Kafka timestamp equal to its event time ``ts`` (now)."""

    PAGES = ("/home", "/search", "/item", "/cart", "/checkout", "/help")

    def __init__(self, bootstrap: str, topic: str, users: int = 40, rate: float = 2.0) -> None:
        self.bootstrap = bootstrap
        self.topic = topic
        self.users = users
        self.rate = rate
        self.sent = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="live-clicks", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def _run(self) -> None:
        from kafka import KafkaProducer

        rng = random.Random()
        producer = KafkaProducer(bootstrap_servers=self.bootstrap, acks="all", linger_ms=50)
        try:
            while not self._stop.wait(rng.expovariate(self.rate)):
                ts = int(time.time() * 1000)
                user = f"user-{rng.randrange(self.users):04d}"
                click = {"user_id": user, "page": rng.choice(self.PAGES), "ts": ts}
                producer.send(self.topic, key=user.encode(), value=json.dumps(click).encode(),
                              timestamp_ms=ts)  # fmt: skip
                self.sent += 1
            producer.flush()
        finally:
            producer.close()


def ensure_topics(bootstrap: str, topics: Mapping[str, int]) -> list[str]:
    """Create the topics that do not exist yet (partitions per topic); the created ones."""
    from kafka import KafkaAdminClient

    admin = KafkaAdminClient(bootstrap_servers=bootstrap)
    try:
        existing = set(admin.list_topics())
    finally:
        admin.close()
    missing = {t: n for t, n in topics.items() if t not in existing}
    if missing:
        create_topics(bootstrap, missing)
    return sorted(missing)


def main() -> int:
    from microbatch.examples.clickstream import ClickstreamConfig
    from microbatch.examples.profile_service import ProfileService

    stop_on_sigterm()
    settings = Settings.from_env()
    home = Path(os.environ.get("AIRFLOW_HOME", settings.home_path / "airflow"))
    port = int(os.environ.get("AIRFLOW__API__PORT", "8080"))
    if not port_is_free(port):
        print(
            f"error: Airflow's port {port} on 127.0.0.1 is in use. Stop the other process, or "
            "set AIRFLOW__API__PORT to a free port.",
            file=sys.stderr,
        )
        return 1
    home.mkdir(parents=True, exist_ok=True)
    stack = LocalStack(settings)
    postgres = stack.services["postgres"]
    connect = stack.services["spark-connect"]
    assert isinstance(postgres, PostgresServer)
    own_database = postgres.sqlalchemy_url(AIRFLOW_DATABASE)
    external = {
        "kafka": "MICROBATCH_KAFKA_BOOTSTRAP_SERVERS" in os.environ,
        "seaweedfs": "MICROBATCH_S3_ENDPOINT_URL" in os.environ,
        "postgres": os.environ.get(DATABASE_VAR, own_database) != own_database,
        "spark-connect": "MICROBATCH_SPARK_MASTER" in os.environ,
    }
    started: list[str] = []
    profiles: ProfileService | None = None
    clicks: LiveClicks | None = None
    airflow = None
    try:
        for name in ("kafka", "seaweedfs", "postgres", "spark-connect"):
            if external[name] or stack.services[name].process.pid() is not None:
                print(f"[stack] {name}: using the running/external service", flush=True)
                continue
            print(f"[stack] starting {name} ...", flush=True)
            begun = time.monotonic()
            stack.start(name)
            started.append(name)
            print(f"[stack] {name} ready in {time.monotonic() - begun:.0f} s", flush=True)
        print(stack.describe(), flush=True)
        env = dict(os.environ)
        env.setdefault("MICROBATCH_CLICKSTREAM_ON_NEW_DATA", "true")
        if not external["postgres"]:
            postgres.create_database(AIRFLOW_DATABASE)
            env |= postgres.airflow_env(AIRFLOW_DATABASE)
        print(f"[airflow] metadata DB: {_without_password(env[DATABASE_VAR])}", flush=True)
        if not external["spark-connect"]:
            env["MICROBATCH_SPARK_MASTER"] = connect.url
        print(f"[airflow] batches run on Spark {env['MICROBATCH_SPARK_MASTER']}", flush=True)
        config = ClickstreamConfig.from_env(settings.s3_bucket)
        if ClickstreamConfig.ENV_PREFIX + "PROFILE_URL" not in env:
            profiles = ProfileService(latency_ms=5, error_rate=0.0, log=home / "profiles.log")
            env[ClickstreamConfig.ENV_PREFIX + "PROFILE_URL"] = profiles.url
            print(f"[example] profile service on {profiles.url}", flush=True)
        bootstrap = settings.kafka_bootstrap_servers
        topics = {config.topic: 2, config.sessions_topic: 1, config.dead_letter_topic: 1}
        created = ensure_topics(bootstrap, topics)
        print(f"[example] topics {', '.join(topics)} ({len(created)} created)", flush=True)

        airflow = AirflowStandalone(home, port, env)
        print(f"[airflow] starting airflow standalone (log: {airflow.log_path}) ...", flush=True)
        airflow.start()
        password = airflow.password("admin")
        airflow.unpause(EXAMPLE_DAG, airflow.token("admin", password))
        clicks = LiveClicks(bootstrap, config.topic)
        clicks.start()
        print(
            f"\nAirflow is up:  {airflow.url}\n  login: admin / {password}\n"
            f"  DAG '{EXAMPLE_DAG}' is unpaused: a batch when clicks arrive "
            f"(on_new_data: {env['MICROBATCH_CLICKSTREAM_ON_NEW_DATA']}) and every 5 minutes;\n"
            f"  live clicks (~{clicks.rate:g}/s) go to topic '{config.topic}'; the Microbatch "
            f"page is {airflow.url}/microbatch/\n"
            "  Ctrl-C stops Airflow, the producer and the services started here.\n",
            flush=True,
        )
        return airflow.wait()
    except KeyboardInterrupt:
        return 0
    except MicrobatchError as exc:
        log = f" (Airflow's log: {airflow.log_path})" if airflow else ""
        print(f"error: {exc}{log}", file=sys.stderr)
        return 1
    finally:
        if clicks is not None:
            clicks.stop()
        if airflow is not None:
            airflow.stop()
            print("[airflow] stopped", flush=True)
        if profiles is not None:
            profiles.stop()
        for name in reversed(started):
            stack.stop(name)
            print(f"[stack] stopped {name}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
