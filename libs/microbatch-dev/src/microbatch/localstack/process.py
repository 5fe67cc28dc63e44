"""Start, watch and stop one local service process, with errors a person can act on.

A service runs detached (its own session) with stdout/stderr in a log file and its pid in
a pid file, so ``make airflow`` can leave it running and ``microbatch-stack down`` can stop
it later from another process. Readiness is a caller-given probe polled until a deadline;
if the process dies or the deadline passes, the error names the service, shows the tail of
its log and says what to do.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from microbatch.errors import ServiceError


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    """True when nothing listens on ``host:port`` and we could bind it."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


class PortTakenError(ServiceError):
    """A service could not bind its port: another process took it after we checked."""


def ephemeral_port_floor(default: int = 32768) -> int:
    """The lowest port the kernel hands to outgoing connections on its own."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return default


def free_port_block(offsets: Sequence[int], start: int = 15000, stop: int | None = None) -> int:
    """A base port ``p`` such that every ``p + offset`` is free on loopback.

    Services like SeaweedFS open several ports at fixed offsets from one another (gRPC at
    +10000), so tests need a whole block rather than one ephemeral port. The block stays
    below the kernel's ephemeral range: there, any outgoing connection (a Kafka client, a
    Spark executor) could take a port between this check and the service's bind.
    """
    stop = ephemeral_port_floor() if stop is None else stop
    rng = int.from_bytes(os.urandom(2), "big")
    span = stop - start - max(offsets)
    for attempt in range(200):
        base = start + (rng + attempt * 7919) % span
        if all(port_is_free(base + off) for off in offsets):
            return base
    raise ServiceError(f"no block of free loopback ports with offsets {list(offsets)} found")


def tail(path: Path, lines: int = 15) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except FileNotFoundError:
        return "(no log written)"
    return "\n".join("    " + line for line in text[-lines:])


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class ServiceProcess:
    """One named background process with a pid file and a log file under ``workdir``."""

    def __init__(self, name: str, workdir: Path) -> None:
        self.name = name
        self.workdir = workdir
        self.log_path = workdir / f"{name}.log"
        self.pid_path = workdir / f"{name}.pid"

    def pid(self) -> int | None:
        """The pid of a running instance (started by this or another process), else None."""
        try:
            pid = int(self.pid_path.read_text().strip())
        except (FileNotFoundError, ValueError):
            return None
        return pid if pid_alive(pid) else None

    def start(
        self,
        argv: Sequence[str],
        *,
        env: dict[str, str] | None = None,
        ready: Callable[[], bool],
        timeout: float,
        hint: str,
        user: str | None = None,
        port_taken_marks: Sequence[str] = (),
    ) -> int:
        """Launch ``argv`` detached and wait until ``ready()`` is true.

        ``hint`` is appended to failure messages: what the user can do about it. ``user``
        runs the process as that account (we must be root), for servers that refuse root.
        A line of this start's log containing one of ``port_taken_marks`` stops the process
        and raises :class:`PortTakenError` at once: a server whose listener failed to bind
        may live on without ever becoming ready.
        """
        self.workdir.mkdir(parents=True, exist_ok=True)
        log_start = self.log_path.stat().st_size if self.log_path.exists() else 0
        with open(self.log_path, "ab") as log:
            try:
                proc = subprocess.Popen(
                    list(argv),
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    env=env,
                    cwd=self.workdir,
                    start_new_session=True,
                    **run_as(user),
                )
            except FileNotFoundError as exc:
                raise ServiceError(
                    f"{self.name}: cannot run {argv[0]!r} ({exc.strerror}). {hint}"
                ) from None
        self.pid_path.write_text(str(proc.pid))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                self.pid_path.unlink(missing_ok=True)
                raise ServiceError(
                    f"{self.name} exited with code {proc.returncode} while starting. "
                    f"{hint}\n  last lines of {self.log_path}:\n{tail(self.log_path)}"
                )
            with contextlib.suppress(Exception):
                if ready():
                    return proc.pid
            if port_taken_marks and _log_mentions(self.log_path, log_start, port_taken_marks):
                self.stop()
                raise PortTakenError(
                    f"{self.name}: its port was taken while it started. {hint}\n"
                    f"  last lines of {self.log_path}:\n{tail(self.log_path)}"
                )
            time.sleep(0.25)
        self.stop()
        raise ServiceError(
            f"{self.name} did not become ready within {timeout:.0f} s. {hint}\n"
            f"  last lines of {self.log_path}:\n{tail(self.log_path)}"
        )

    def stop(self, timeout: float = 20.0, sig: int = signal.SIGTERM) -> bool:
        """``sig`` to the process group, SIGKILL after ``timeout``. True if something ran."""
        pid = self.pid()
        self.pid_path.unlink(missing_ok=True)
        if pid is None:
            return False
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, sig)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not _reap(pid):
                return True
            time.sleep(0.1)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)
        _reap(pid)
        return True


def run_as(user: str | None) -> dict[str, Any]:
    """``subprocess`` keyword arguments that run a child as ``user`` with that account's
    own group and no other (we must be root); none for ``None``."""
    if user is None:
        return {}
    import pwd

    return {"user": user, "group": pwd.getpwnam(user).pw_gid, "extra_groups": []}


def _log_mentions(path: Path, offset: int, marks: Sequence[str]) -> bool:
    """True if the log past ``offset`` (what this start wrote) contains one of ``marks``."""
    try:
        with open(path, "rb") as log:
            log.seek(offset)
            text = log.read().decode(errors="replace")
    except FileNotFoundError:
        return False
    return any(mark in text for mark in marks)


def _reap(pid: int) -> bool:
    """True while ``pid`` is alive; collects it if it is our exited child."""
    with contextlib.suppress(ChildProcessError):
        done, _ = os.waitpid(pid, os.WNOHANG)
        if done == pid:
            return False
    return pid_alive(pid)
