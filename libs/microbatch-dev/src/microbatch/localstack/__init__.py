"""The embedded local stack: a real Kafka broker, a real S3-compatible store and a real
PostgreSQL (Airflow's metadata DB) on loopback, plus optional Spark services.

Used by ``make demo``, ``make airflow`` and the test fixtures alike; production points the
settings at external services and never starts this.
"""

from __future__ import annotations

import signal
import sys
from pathlib import Path

from microbatch.errors import ConfigError
from microbatch.localstack.kafka import KafkaBroker
from microbatch.localstack.postgres import PostgresServer, configured_port
from microbatch.localstack.seaweedfs import SeaweedFS
from microbatch.localstack.spark_cluster import SparkStandaloneCluster
from microbatch.localstack.spark_connect import SparkConnectServer
from microbatch.settings import Settings

__all__ = [
    "KafkaBroker",
    "LocalStack",
    "PostgresServer",
    "SeaweedFS",
    "SparkConnectServer",
    "SparkStandaloneCluster",
    "stop_on_sigterm",
]

# Default ports of the optional Spark services (``make cluster`` / ``make connect``).
SPARK_MASTER_PORT = 7077
SPARK_CONNECT_PORT = 15002


def stop_on_sigterm() -> None:
    """Turn SIGTERM into SystemExit so `finally:` blocks stop the services we started."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))


Service = KafkaBroker | SeaweedFS | PostgresServer | SparkStandaloneCluster | SparkConnectServer


class LocalStack:
    """Kafka, SeaweedFS and PostgreSQL for one :class:`Settings` (PostgreSQL's port:
    ``MICROBATCH_POSTGRES_PORT``), and the Spark services, with data under ``workdir``."""

    def __init__(self, settings: Settings, workdir: Path | None = None) -> None:
        self.settings = settings
        root = workdir or settings.home_path / "stack"
        self.services: dict[str, Service] = {
            "kafka": KafkaBroker(settings, root / "kafka"),
            "seaweedfs": SeaweedFS(settings, root / "seaweedfs"),
            "postgres": PostgresServer(configured_port(), root / "postgres"),
            "spark-cluster": SparkStandaloneCluster(SPARK_MASTER_PORT, root / "spark-cluster"),
            "spark-connect": SparkConnectServer(SPARK_CONNECT_PORT, root / "spark-connect"),
        }

    def _service(self, name: str) -> Service:
        try:
            return self.services[name]
        except KeyError:
            raise ConfigError(f"unknown service {name!r}; known: {sorted(self.services)}") from None

    def start(self, name: str) -> None:
        self._service(name).start()

    def stop(self, name: str) -> bool:
        return bool(self._service(name).stop())

    def stop_all(self) -> None:
        for name in self.services:
            self.stop(name)

    def describe(self) -> str:
        cluster = self.services["spark-cluster"]
        connect = self.services["spark-connect"]
        postgres = self.services["postgres"]
        rows = [
            ("Kafka", self.settings.kafka_bootstrap_servers, self.services["kafka"]),
            ("SeaweedFS", self.settings.s3_endpoint_url, self.services["seaweedfs"]),
            ("PostgreSQL", f"127.0.0.1:{postgres.port}", postgres),
            ("Spark", cluster.url, cluster),
            ("Connect", connect.url, connect),
        ]
        lines = []
        for label, address, service in rows:
            pid = service.process.pid()
            state = f"running (pid {pid})" if pid else "stopped"
            lines.append(f"  {label:<10} {address:<28} {state}")
        return "\n".join(lines)
