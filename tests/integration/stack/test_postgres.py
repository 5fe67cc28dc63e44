"""The local stack's PostgreSQL: a real server from Debian's binaries, and each way it
cannot start giving an error that names the port, the folder or the fix."""

from __future__ import annotations

import os
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from microbatch.errors import ServiceError
from microbatch.localstack import postgres as pg
from microbatch.localstack.postgres import PostgresServer
from microbatch.localstack.process import free_port_block

pytestmark = pytest.mark.integration


@pytest.fixture
def workdir() -> Iterator[Path]:
    """A folder the server's account may enter (pytest's own tmp is root's only)."""
    import shutil

    path = Path(tempfile.mkdtemp(prefix="microbatch-pg-test-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _server(workdir: Path) -> PostgresServer:
    return PostgresServer(free_port_block([0]), workdir, durable=False)


def test_a_cluster_keeps_its_data_across_a_restart(workdir):
    server = _server(workdir)
    server.start()
    try:
        assert server.create_database("kept")
        with psycopg.connect(server.dsn("kept"), autocommit=True) as conn:
            conn.execute("CREATE TABLE t (k int primary key)")
            conn.execute("INSERT INTO t VALUES (1), (2)")
        server.stop()
        server.start()
        with psycopg.connect(server.dsn("kept")) as conn:
            assert conn.execute("SELECT count(*) FROM t").fetchone() == (2,)
        assert not server.create_database("kept")  # idempotent
    finally:
        server.stop()


def test_a_taken_port_names_the_port_and_the_variable(workdir):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]

        with pytest.raises(ServiceError, match=rf"port {port} on 127.0.0.1 is in use") as err:
            PostgresServer(port, workdir).start()

    assert pg.PORT_VARIABLE in str(err.value)


def test_a_stale_pid_file_of_a_killed_server_is_cleared(workdir):
    server = _server(workdir)
    server.start()
    server.stop()
    # A server killed with SIGKILL leaves its postmaster.pid; the pid is gone by now.
    (server.data / "postmaster.pid").write_text("999999\n" + str(server.data) + "\n")

    server.start()
    try:
        with psycopg.connect(server.dsn()) as conn:
            assert conn.execute("SELECT 1").fetchone() == (1,)
    finally:
        server.stop()


def test_a_pid_file_of_a_running_server_is_refused_with_its_pid(workdir, postgres):
    server = _server(workdir)
    server.start()
    server.stop()
    running = postgres.process.pid()  # the run's own server: a live postgres process
    (server.data / "postmaster.pid").write_text(f"{running}\n{server.data}\n")

    with pytest.raises(ServiceError, match=rf"a server \(pid {running}\) already runs") as err:
        server.start()

    assert str(server.data) in str(err.value) and f"kill -INT {running}" in str(err.value)


def test_a_cluster_of_another_version_names_the_folder_and_both_versions(workdir):
    server = _server(workdir)
    server.start()
    server.stop()
    have = pg.server_major_version(pg.server_bindir())
    (server.data / "PG_VERSION").write_text("9\n")

    with pytest.raises(ServiceError, match=r"holds a PostgreSQL 9 cluster") as err:
        server.start()

    message = str(err.value)
    assert f"binaries are PostgreSQL {have}" in message and f"rm -rf {server.data}" in message


def test_missing_server_binaries_say_how_to_install_them(workdir, monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(pg, "INSTALL_ROOT", tmp_path / "nowhere")

    with pytest.raises(ServiceError, match=r"server binaries .* missing.*apt-get install"):
        _server(workdir).start()


@pytest.mark.skipif(os.geteuid() != 0, reason="only root hands the server to another account")
def test_as_root_without_the_server_account_says_what_to_install(workdir, monkeypatch):
    monkeypatch.setattr(pg, "SERVER_ACCOUNT", "no-such-account-microbatch")

    with pytest.raises(ServiceError, match=r"refuses to run as root.*no-such-account"):
        _server(workdir).start()


@pytest.mark.skipif(os.geteuid() != 0, reason="only root hands the server to another account")
def test_as_root_a_folder_the_server_account_cannot_enter_is_named(tmp_path):
    closed = tmp_path / "closed"
    closed.mkdir(mode=0o700)

    with pytest.raises(ServiceError, match=r"may not enter") as err:
        _server(closed / "pg").start()

    assert str(closed) in str(err.value) and "chmod o+x" in str(err.value)
