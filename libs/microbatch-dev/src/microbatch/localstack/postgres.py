"""PostgreSQL as the local stack's database: Airflow's metadata DB, as production runs it.

A cluster is ``initdb``'d once in ``<workdir>/data`` and served by ``postgres`` on
``127.0.0.1:<port>`` only (TCP, no Unix socket), with a password (``scram-sha-256``) for
the stack's user :data:`LOCAL_USER`. The server binaries come from Debian's
``postgresql`` package (``/usr/lib/postgresql/<major>/bin``), found on ``PATH`` first.
PostgreSQL refuses to run as root: run as root, the server runs as the package's
``postgres`` account, which then owns ``workdir`` (every folder above it must let that
account pass).

``durable=False`` (the tests) turns off ``fsync`` and synchronous commits: a crash of
the machine may lose the database, a crash of a process never does.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import re
import shutil
import signal
import stat
import subprocess
from pathlib import Path

from microbatch.errors import ServiceError
from microbatch.localstack.process import ServiceProcess, pid_alive, port_is_free, run_as

#: The stack's database user and password (like SeaweedFS's local keys: loopback only).
LOCAL_USER = "microbatch"
LOCAL_PASSWORD = "microbatch"
#: The port of ``make airflow``'s server; 5433 leaves a system PostgreSQL's 5432 alone.
DEFAULT_PORT = 5433
PORT_VARIABLE = "MICROBATCH_POSTGRES_PORT"
#: The account the server runs as when we are root (Debian's package creates it).
SERVER_ACCOUNT = "postgres"
#: Where Debian's packages put each major version's server binaries.
INSTALL_ROOT = Path("/usr/lib/postgresql")
INSTALL_HINT = "install Debian's PostgreSQL server: apt-get install -y postgresql"


def configured_port() -> int:
    """``MICROBATCH_POSTGRES_PORT``, else :data:`DEFAULT_PORT`."""
    raw = os.environ.get(PORT_VARIABLE, "") or str(DEFAULT_PORT)
    try:
        port = int(raw)
    except ValueError:
        port = 0
    if not 0 < port < 65536:
        raise ServiceError(f"{PORT_VARIABLE}={raw!r}: expected a TCP port number (1-65535)")
    return port


def server_bindir() -> Path:
    """The folder holding ``initdb`` and ``postgres``: ``PATH`` first, then the newest
    ``/usr/lib/postgresql/<major>/bin``."""
    on_path = shutil.which("initdb")
    if on_path:
        folder = Path(on_path).resolve().parent
        if (folder / "postgres").exists():
            return folder
    installed = sorted(
        INSTALL_ROOT.glob("*/bin/postgres"),
        key=lambda p: int(p.parent.parent.name) if p.parent.parent.name.isdigit() else 0,
    )
    if installed:
        return installed[-1].parent
    raise ServiceError(
        "PostgreSQL: the server binaries (initdb, postgres) are missing; "
        f"{INSTALL_HINT} (`make postgres` does it as root)"
    )


def server_major_version(bindir: Path) -> str:
    """``"15"`` for PostgreSQL 15.x (from ``postgres --version``)."""
    out = subprocess.run(
        [str(bindir / "postgres"), "--version"], capture_output=True, text=True, check=False
    ).stdout
    found = re.search(r"\(PostgreSQL\) (\d+)", out)
    if not found:
        raise ServiceError(f"PostgreSQL: cannot read the version of {bindir / 'postgres'}: {out!r}")
    return found.group(1)


def _server_account() -> str | None:
    """The account to run the server as: None when we are not root."""
    if os.geteuid() != 0:
        return None
    try:
        pwd.getpwnam(SERVER_ACCOUNT)
    except KeyError:
        raise ServiceError(
            "PostgreSQL refuses to run as root, and there is no "
            f"{SERVER_ACCOUNT!r} account to run it as: {INSTALL_HINT} (it creates the "
            "account), or run as an ordinary user"
        ) from None
    return SERVER_ACCOUNT


def _unreachable_parent(folder: Path, account: str) -> Path | None:
    """The first folder above ``folder`` that ``account`` may not pass through."""
    entry = pwd.getpwnam(account)
    for parent in folder.resolve().parents:
        mode = parent.stat()
        if mode.st_uid == entry.pw_uid:
            continue
        if mode.st_gid == entry.pw_gid and mode.st_mode & stat.S_IXGRP:
            continue
        if not mode.st_mode & stat.S_IXOTH:
            return parent
    return None


def _process_is_postgres(pid: int) -> bool:
    with contextlib.suppress(OSError):
        return b"postgres" in Path(f"/proc/{pid}/cmdline").read_bytes()
    return pid_alive(pid)


class PostgresServer:
    """One PostgreSQL cluster in ``workdir`` served on ``127.0.0.1:port``."""

    def __init__(self, port: int, workdir: Path, *, durable: bool = True) -> None:
        self.port = port
        self.workdir = Path(workdir)
        self.data = self.workdir / "data"
        self.durable = durable
        self.process = ServiceProcess("postgres", self.workdir)

    # ---- addresses -----------------------------------------------------------------------

    def dsn(self, database: str = "postgres") -> str:
        """A libpq URI (psycopg, psql)."""
        return f"postgresql://{LOCAL_USER}:{LOCAL_PASSWORD}@127.0.0.1:{self.port}/{database}"

    def sqlalchemy_url(self, database: str) -> str:
        """SQLAlchemy's URL with psycopg 3, which serves both Airflow's sync and async
        engines (``[database] sql_alchemy_conn`` and ``sql_alchemy_conn_async``)."""
        return self.dsn(database).replace("postgresql://", "postgresql+psycopg://", 1)

    def airflow_env(self, database: str) -> dict[str, str]:
        """The variables that put Airflow's metadata DB on ``database``."""
        url = self.sqlalchemy_url(database)
        return {
            "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": url,
            "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN_ASYNC": url,
        }

    # ---- life cycle ----------------------------------------------------------------------

    def start(self, timeout: float = 60.0) -> None:
        """Initialise the cluster if needed and start the server; a no-op when this
        folder's server already runs."""
        if self.process.pid() is not None:
            return
        bindir = server_bindir()
        account = _server_account()
        self._check_port()
        self.workdir.mkdir(parents=True, exist_ok=True)
        if account:
            blocked = _unreachable_parent(self.workdir, account)
            if blocked is not None:
                raise ServiceError(
                    f"PostgreSQL runs as {account!r} (it refuses root), and {account!r} may "
                    f"not enter {blocked} (mode {stat.filemode(blocked.stat().st_mode)}), "
                    f"above {self.workdir}: `chmod o+x {blocked}`, or put the stack's folder "
                    "(MICROBATCH_HOME) where every user may pass"
                )
            entry = pwd.getpwnam(account)
            os.chown(self.workdir, entry.pw_uid, entry.pw_gid)
        if (self.data / "PG_VERSION").exists():
            self._check_version(bindir)
            self._clear_stale_pid_file()
        else:
            self._initdb(bindir, account)
        argv = [
            str(bindir / "postgres"),
            "-D", str(self.data),
            "-c", "listen_addresses=127.0.0.1",
            "-c", f"port={self.port}",
            "-c", "unix_socket_directories=",
            "-c", "max_connections=300",
        ]  # fmt: skip
        if not self.durable:
            argv += ["-c", "fsync=off", "-c", "synchronous_commit=off",
                     "-c", "full_page_writes=off"]  # fmt: skip
        self.process.start(
            argv,
            ready=self._answers,
            timeout=timeout,
            user=account,
            hint=f"Check the log below; the cluster is {self.data}.",
        )

    def stop(self, timeout: float = 30.0) -> bool:
        """A fast shutdown (SIGINT: open sessions are ended, not waited for)."""
        return self.process.stop(timeout, sig=signal.SIGINT)

    def _check_port(self) -> None:
        if not port_is_free(self.port):
            raise ServiceError(
                f"PostgreSQL: port {self.port} on 127.0.0.1 is in use (another PostgreSQL? "
                "`ss -ltnp` shows who holds it). Stop it, or choose another port with "
                f"{PORT_VARIABLE}."
            )

    def _check_version(self, bindir: Path) -> None:
        have = (self.data / "PG_VERSION").read_text().strip()
        want = server_major_version(bindir)
        if have != want:
            raise ServiceError(
                f"PostgreSQL: {self.data} holds a PostgreSQL {have} cluster, but the server "
                f"binaries are PostgreSQL {want} ({bindir}). Remove the folder to start afresh "
                f"(`rm -rf {self.data}`; Airflow's metadata is lost), or install PostgreSQL "
                f"{have}'s server (apt-get install -y postgresql-{have})."
            )

    def _clear_stale_pid_file(self) -> None:
        """A ``postmaster.pid`` left by a killed server is removed; one whose server still
        runs (not started by this stack) is an error."""
        lock = self.data / "postmaster.pid"
        try:
            pid = int(lock.read_text().split("\n", 1)[0])
        except (FileNotFoundError, ValueError):
            return
        if pid_alive(pid) and _process_is_postgres(pid):
            raise ServiceError(
                f"PostgreSQL: a server (pid {pid}) already runs on {self.data} ({lock}), "
                f"not started by this stack: stop it (`kill -INT {pid}`), then retry"
            )
        lock.unlink()

    def _initdb(self, bindir: Path, account: str | None) -> None:
        pwfile = self.workdir / "initdb.pw"
        pwfile.write_text(LOCAL_PASSWORD + "\n")
        if account:
            entry = pwd.getpwnam(account)
            os.chown(pwfile, entry.pw_uid, entry.pw_gid)
        log = self.workdir / "initdb.log"
        try:
            with open(log, "wb") as out:
                proc = subprocess.run(
                    [str(bindir / "initdb"), "-D", str(self.data), "-U", LOCAL_USER,
                     f"--pwfile={pwfile}", "--auth=scram-sha-256", "-E", "UTF8",
                     "--locale=C", "--no-instructions"],
                    stdout=out, stderr=subprocess.STDOUT, check=False, cwd=self.workdir,
                    **run_as(account),
                )  # fmt: skip
        finally:
            pwfile.unlink(missing_ok=True)
        if proc.returncode != 0:
            tail = log.read_text(errors="replace").strip().splitlines()[-8:]
            raise ServiceError(
                f"PostgreSQL: initdb of {self.data} failed (exit {proc.returncode}):\n    "
                + "\n    ".join(tail)
                + f"\n  Remove {self.data} if it is half made, and check that the folder is "
                "writable."
            )

    def _answers(self) -> bool:
        import psycopg

        with psycopg.connect(self.dsn(), connect_timeout=2) as conn:
            conn.execute("SELECT 1")
        return True

    # ---- databases -----------------------------------------------------------------------

    def create_database(self, name: str, template: str | None = None) -> bool:
        """Create ``name`` (a copy of ``template`` when given); False if it existed."""
        import psycopg
        from psycopg import sql

        if not re.fullmatch(r"[a-z_][a-z0-9_]{0,62}", name):
            raise ServiceError(f"PostgreSQL: {name!r} is not a plain database name")
        with psycopg.connect(self.dsn(), autocommit=True) as conn:
            exists = conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,))
            if exists.fetchone():
                return False
            statement = sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name))
            if template:
                statement += sql.SQL(" TEMPLATE {}").format(sql.Identifier(template))
            conn.execute(statement)
        return True
