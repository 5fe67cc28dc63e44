"""A long-running Spark Connect server: the warm mode.

The server (``org.apache.spark.sql.connect.service.SparkConnectServer``, shipped in
pyspark's jars) holds one Spark application; each batch connects to it with
``MICROBATCH_SPARK_MASTER=sc://127.0.0.1:<port>`` instead of starting a JVM. Because the
runtime uses only the DataFrame API with Arrow, the same job code runs on both. The server
gets Spark's Kafka connector jars when ``make jars`` resolved them, so stage 1 reads Kafka
with the JVM source there too.
"""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Sequence
from pathlib import Path

from microbatch.errors import ServiceError
from microbatch.executables import find_executable
from microbatch.localstack.process import ServiceProcess, port_is_free
from microbatch.settings import Settings
from microbatch.spark_jars import spark_kafka_jars

SERVER_CLASS = "org.apache.spark.sql.connect.service.SparkConnectServer"


def _listening(port: int) -> bool:
    with socket.create_connection(("127.0.0.1", port), timeout=1):
        return True


class SparkConnectServer:
    """Start/stop a Connect server on ``port`` whose executors run ``master``.

    ``jars``: extra jars for the server's classpath; None means the Kafka connector's, if
    resolved under the settings' home (``MICROBATCH_HOME``) when the server starts."""

    def __init__(
        self,
        port: int,
        workdir: Path,
        master: str = "local[*]",
        jars: Sequence[str | Path] | None = None,
    ) -> None:
        self.port = port
        self.workdir = workdir
        self.master = master
        self.jars = jars
        self.process = ServiceProcess("spark-connect", workdir)

    @property
    def url(self) -> str:
        return f"sc://127.0.0.1:{self.port}"

    def start(self, timeout: float = 120.0) -> None:
        if self.process.pid() is not None:
            return
        if not port_is_free(self.port):
            raise ServiceError(
                f"Spark Connect: port {self.port} on 127.0.0.1 is in use. Stop the other "
                "process or pick another port."
            )
        submit = find_executable("spark-submit")
        if not submit:
            raise ServiceError("Spark Connect: spark-submit not found; run `make venv`")
        env = dict(os.environ)
        env.setdefault("PYSPARK_PYTHON", sys.executable)
        env["SPARK_LOCAL_IP"] = "127.0.0.1"
        jars = self.jars
        if jars is None:
            jars = spark_kafka_jars(Settings.from_env().home_path)
        extra = ["--jars", ",".join(str(jar) for jar in jars)] if jars else []
        self.process.start(
            [submit, "--class", SERVER_CLASS, "--master", self.master,
             "--conf", f"spark.connect.grpc.binding.port={self.port}",
             "--conf", "spark.connect.grpc.binding.address=127.0.0.1",
             "--conf", "spark.driver.host=127.0.0.1",
             "--conf", "spark.ui.enabled=false",
             "--conf", "spark.sql.execution.arrow.pyspark.enabled=true",
             "--conf", "spark.sql.session.timeZone=UTC",
             *extra,
             "spark-internal"],
            env=env,
            ready=lambda: _listening(self.port),
            timeout=timeout,
            hint=f"See {self.process.log_path}.",
        )  # fmt: skip

    def stop(self) -> bool:
        return self.process.stop()
