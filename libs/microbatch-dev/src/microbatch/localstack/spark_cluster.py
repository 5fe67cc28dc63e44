"""A real Spark standalone cluster on loopback: one master and N workers.

pyspark ships ``bin/spark-class``, which runs the standalone daemons
(``org.apache.spark.deploy.master.Master``, ``org.apache.spark.deploy.worker.Worker``).
Jobs then run with ``MICROBATCH_SPARK_MASTER=spark://127.0.0.1:<port>`` exactly as on a
remote cluster: executors are separate JVMs with their own Python workers, so checkpoint
and output locations must be on shared storage (S3), never a local folder.
"""

from __future__ import annotations

import os
import sys
import urllib.request
from pathlib import Path

from microbatch.errors import ServiceError
from microbatch.executables import find_executable
from microbatch.localstack.process import ServiceProcess, port_is_free

WEBUI_OFFSET = 1  # the master's web UI at port + 1; worker i's UI at port + 2 + i


def _spark_class() -> str:
    found = find_executable("spark-class")
    if not found:
        raise ServiceError("Spark cluster: spark-class not found; run `make venv` (pyspark)")
    return found


def _master_alive_workers(webui: int) -> int:
    with urllib.request.urlopen(f"http://127.0.0.1:{webui}/json/", timeout=2) as response:
        import json

        return int(json.load(response).get("aliveworkers", 0))


class SparkStandaloneCluster:
    """Start/stop a master on ``port`` and ``workers`` workers with data under ``workdir``."""

    def __init__(
        self, port: int, workdir: Path, workers: int = 2, cores: int = 1, memory: str = "1g"
    ) -> None:
        self.port = port
        self.workdir = workdir
        self.workers = workers
        self.cores = cores
        self.memory = memory
        self.process = ServiceProcess("spark-master", workdir)  # the master
        self.worker_processes = [
            ServiceProcess(f"spark-worker-{i}", workdir) for i in range(workers)
        ]

    @property
    def url(self) -> str:
        return f"spark://127.0.0.1:{self.port}"

    def _env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.setdefault("PYSPARK_PYTHON", sys.executable)
        env["SPARK_LOCAL_IP"] = "127.0.0.1"
        env["SPARK_WORKER_DIR"] = str(self.workdir / "work")
        env["SPARK_LOG_DIR"] = str(self.workdir)
        return env

    def start(self, timeout: float = 90.0) -> None:
        webui = self.port + WEBUI_OFFSET
        ports = [self.port, webui] + [webui + 1 + i for i in range(self.workers)]
        taken = [p for p in ports if not port_is_free(p)]
        if self.process.pid() is not None:
            return
        if taken:
            raise ServiceError(
                f"Spark cluster: port(s) {taken} on 127.0.0.1 are in use (master {self.port}, "
                f"web UIs from {webui}). Stop the other process or pick another port."
            )
        spark_class = _spark_class()
        env = self._env()
        self.process.start(
            [spark_class, "org.apache.spark.deploy.master.Master",
             "--host", "127.0.0.1", "--port", str(self.port), "--webui-port", str(webui)],
            env=env,
            ready=lambda: _master_alive_workers(webui) >= 0,
            timeout=timeout,
            hint=f"See {self.process.log_path}.",
        )  # fmt: skip
        for i, worker in enumerate(self.worker_processes):
            worker.start(
                [spark_class, "org.apache.spark.deploy.worker.Worker", self.url,
                 "--host", "127.0.0.1", "--cores", str(self.cores), "--memory", self.memory,
                 "--webui-port", str(webui + 1 + i), "--work-dir", str(self.workdir / "work")],
                env=env,
                ready=lambda n=i + 1: _master_alive_workers(webui) >= n,
                timeout=timeout,
                hint=f"See {worker.log_path}.",
            )  # fmt: skip

    def stop(self) -> bool:
        stopped = [worker.stop() for worker in self.worker_processes]
        return self.process.stop() or any(stopped)
