"""``make airflow``: the local stack plus ``airflow standalone``, until Ctrl-C.

Airflow runs as a subprocess (this module imports nothing from Airflow). Its settings
come from the environment the Makefile exports (``AIRFLOW_HOME``, dags and plugins
folders). Once the API server answers, the UI address and the admin login are printed.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from microbatch.errors import MicrobatchError, ServiceError
from microbatch.localstack import LocalStack, stop_on_sigterm
from microbatch.localstack.process import port_is_free
from microbatch.settings import Settings


def _wait_for_api(url: str, proc: subprocess.Popen, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise ServiceError(f"airflow standalone exited with code {proc.returncode}")
        try:
            with urllib.request.urlopen(f"{url}/api/v2/version", timeout=2):
                return
        except OSError:
            time.sleep(1)
    raise ServiceError(f"Airflow API at {url} did not answer within {timeout:.0f} s")


def _admin_password(home: Path) -> str:
    path = home / "simple_auth_manager_passwords.json.generated"
    for _ in range(30):
        if path.exists():
            return json.loads(path.read_text()).get("admin", "?")
        time.sleep(1)
    return f"(see {path})"


def main() -> int:
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
    stack = LocalStack(settings)
    try:
        for name in ("kafka", "seaweedfs"):
            print(f"[stack] starting {name} ...", flush=True)
            stack.start(name)
        print(stack.describe(), flush=True)
    except MicrobatchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    env = dict(os.environ) | {"AIRFLOW__API__PORT": str(port)}
    log_path = home / "standalone.log"
    home.mkdir(parents=True, exist_ok=True)
    print(f"[airflow] starting airflow standalone (log: {log_path}) ...", flush=True)
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            ["airflow", "standalone"], env=env, stdout=log, stderr=subprocess.STDOUT
        )
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_for_api(url, proc)
        print(
            f"\nAirflow is up:  {url}\n  login: admin / {_admin_password(home)}\n"
            "  Ctrl-C stops Airflow and the local stack.\n",
            flush=True,
        )
        proc.wait()
        return proc.returncode or 0
    except KeyboardInterrupt:
        return 0
    except MicrobatchError as exc:
        print(f"error: {exc}; last log lines in {log_path}", file=sys.stderr)
        return 1
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
        stack.stop_all()
        print("[stack] stopped")


if __name__ == "__main__":
    sys.exit(main())
