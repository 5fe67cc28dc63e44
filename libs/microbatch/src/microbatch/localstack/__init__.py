"""The embedded local stack: a real Kafka broker and a real S3-compatible store on loopback.

Used by ``make demo``, ``make airflow`` and the test fixtures alike; production points the
settings at external services and never starts this.
"""

from __future__ import annotations

import signal
import sys
from pathlib import Path

from microbatch.errors import ConfigError
from microbatch.localstack.kafka import KafkaBroker
from microbatch.localstack.seaweedfs import SeaweedFS
from microbatch.settings import Settings

__all__ = ["KafkaBroker", "LocalStack", "SeaweedFS", "stop_on_sigterm"]


def stop_on_sigterm() -> None:
    """Turn SIGTERM into SystemExit so `finally:` blocks stop the services we started."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))


class LocalStack:
    """Kafka and SeaweedFS for one :class:`Settings`, with data under ``workdir``."""

    def __init__(self, settings: Settings, workdir: Path | None = None) -> None:
        self.settings = settings
        root = workdir or settings.home_path / "stack"
        self.services = {
            "kafka": KafkaBroker(settings, root / "kafka"),
            "seaweedfs": SeaweedFS(settings, root / "seaweedfs"),
        }

    def _service(self, name: str) -> KafkaBroker | SeaweedFS:
        try:
            return self.services[name]
        except KeyError:
            raise ConfigError(f"unknown service {name!r}; known: {sorted(self.services)}") from None

    def start(self, name: str) -> None:
        self._service(name).start()

    def stop(self, name: str) -> bool:
        return self._service(name).stop()

    def start_all(self) -> None:
        for name in self.services:
            self.start(name)

    def stop_all(self) -> None:
        for name in self.services:
            self.stop(name)

    def describe(self) -> str:
        kafka = self.services["kafka"].process.pid()
        s3 = self.services["seaweedfs"].process.pid()
        return "\n".join(
            [
                f"  Kafka      {self.settings.kafka_bootstrap_servers:<28} "
                + (f"running (pid {kafka})" if kafka else "stopped"),
                f"  SeaweedFS  {self.settings.s3_endpoint_url:<28} "
                + (f"running (pid {s3}), bucket {self.settings.s3_bucket}" if s3 else "stopped"),
            ]
        )
