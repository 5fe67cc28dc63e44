"""One settings object for jobs, DAGs, the plugin and the tests.

Precedence, highest first: an explicit keyword argument to :meth:`Settings.from_env`,
then the ``MICROBATCH_*`` environment variable, then the default below. The defaults
describe the embedded local stack (``make demo``, ``make test``); pointing microbatch at
a real Kafka cluster, AWS S3 / MinIO or a Spark cluster is a matter of setting the
variables, never of changing code. The library never reads Airflow connections: the
plugin translates connections into keyword arguments here.

Variables (each maps to the field of the same name, lower-cased, without the prefix):

- ``MICROBATCH_KAFKA_BOOTSTRAP_SERVERS``: comma-separated ``host:port``; ``127.0.0.1:9092``
- ``MICROBATCH_KAFKA_SECURITY_PROTOCOL``: ``PLAINTEXT``, ``SSL``, ``SASL_PLAINTEXT`` or
  ``SASL_SSL``; ``PLAINTEXT``
- ``MICROBATCH_KAFKA_SASL_MECHANISM``: ``PLAIN``, ``SCRAM-SHA-256`` or ``SCRAM-SHA-512``
  (with a ``SASL_*`` protocol); ``PLAIN``
- ``MICROBATCH_KAFKA_SASL_USERNAME`` / ``MICROBATCH_KAFKA_SASL_PASSWORD``: the SASL user
  (the password is never logged); empty
- ``MICROBATCH_KAFKA_SSL_CAFILE``: PEM file of the CAs to trust (``SSL``/``SASL_SSL``);
  empty = the system's
- ``MICROBATCH_S3_ENDPOINT_URL``: S3 API endpoint, empty for AWS; ``http://127.0.0.1:8333``
- ``MICROBATCH_S3_ACCESS_KEY_ID``: access key; ``microbatch``
- ``MICROBATCH_S3_SECRET_ACCESS_KEY``: secret key, never logged; ``microbatch-secret``
- ``MICROBATCH_S3_REGION``: region name; ``us-east-1``
- ``MICROBATCH_S3_BUCKET``: bucket for checkpoints and outputs; ``microbatch``
- ``MICROBATCH_SPARK_MASTER``: Spark master URL (``local[*]``, ``spark://host:7077``,
  ``k8s://...``, ``yarn``); ``local[*]``
- ``MICROBATCH_HOME``: local folder for downloaded jars and service data; ``./.local``
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from microbatch.errors import ConfigError

ENV_PREFIX = "MICROBATCH_"
_SECRET_FIELDS = frozenset({"s3_secret_access_key", "kafka_sasl_password"})
KAFKA_SECURITY_PROTOCOLS = ("PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL")
KAFKA_SASL_MECHANISMS = ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512")


@dataclasses.dataclass(frozen=True)
class Settings:
    """Where the services are. Build with :meth:`from_env`; immutable afterwards."""

    kafka_bootstrap_servers: str = "127.0.0.1:9092"
    kafka_security_protocol: str = "PLAINTEXT"
    kafka_sasl_mechanism: str = "PLAIN"
    kafka_sasl_username: str = ""
    kafka_sasl_password: str = ""
    kafka_ssl_cafile: str = ""
    s3_endpoint_url: str = "http://127.0.0.1:8333"
    s3_access_key_id: str = "microbatch"
    s3_secret_access_key: str = "microbatch-secret"
    s3_region: str = "us-east-1"
    s3_bucket: str = "microbatch"
    spark_master: str = "local[*]"
    home: str = ".local"

    def __post_init__(self) -> None:
        if not self.kafka_bootstrap_servers.strip():
            raise ConfigError(
                "MICROBATCH_KAFKA_BOOTSTRAP_SERVERS is empty: give at least one host:port"
            )
        for server in self.kafka_bootstrap_servers.split(","):
            host, _, port = server.strip().rpartition(":")
            if not host or not port.isdigit():
                raise ConfigError(
                    f"MICROBATCH_KAFKA_BOOTSTRAP_SERVERS has {server!r}: expected host:port"
                )
        self._check_kafka_security()
        if self.s3_endpoint_url and urlparse(self.s3_endpoint_url).scheme not in ("http", "https"):
            raise ConfigError(
                f"MICROBATCH_S3_ENDPOINT_URL={self.s3_endpoint_url!r}: expected an http(s):// URL"
            )
        if len(self.s3_bucket) < 3:
            raise ConfigError(
                f"MICROBATCH_S3_BUCKET={self.s3_bucket!r}: S3 bucket names need 3+ characters"
            )

    def _check_kafka_security(self) -> None:
        protocol = self.kafka_security_protocol
        if protocol not in KAFKA_SECURITY_PROTOCOLS:
            raise ConfigError(
                f"MICROBATCH_KAFKA_SECURITY_PROTOCOL={protocol!r}: expected one of "
                f"{', '.join(KAFKA_SECURITY_PROTOCOLS)}"
            )
        if not protocol.startswith("SASL_"):
            return
        if self.kafka_sasl_mechanism not in KAFKA_SASL_MECHANISMS:
            raise ConfigError(
                f"MICROBATCH_KAFKA_SASL_MECHANISM={self.kafka_sasl_mechanism!r}: expected one "
                f"of {', '.join(KAFKA_SASL_MECHANISMS)}"
            )
        if not self.kafka_sasl_username or not self.kafka_sasl_password:
            raise ConfigError(
                f"MICROBATCH_KAFKA_SECURITY_PROTOCOL={protocol} needs "
                "MICROBATCH_KAFKA_SASL_USERNAME and MICROBATCH_KAFKA_SASL_PASSWORD"
            )

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: Any) -> Settings:
        """Read ``MICROBATCH_*`` variables from ``env`` (default: ``os.environ``).

        Keyword arguments win over the environment; unknown names are an error.
        """
        env = os.environ if env is None else env
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(overrides) - names
        if unknown:
            raise ConfigError(f"unknown setting(s) {sorted(unknown)}; known: {sorted(names)}")
        values: dict[str, Any] = {}
        for name in names:
            if name in overrides and overrides[name] is not None:
                values[name] = overrides[name]
            elif ENV_PREFIX + name.upper() in env:
                values[name] = env[ENV_PREFIX + name.upper()]
        return cls(**values)

    @staticmethod
    def env_names() -> list[str]:
        """Every environment variable this module reads (docker-compose is checked against it)."""
        return [ENV_PREFIX + f.name.upper() for f in dataclasses.fields(Settings)]

    def to_env(self) -> dict[str, str]:
        """The settings as ``MICROBATCH_*`` variables, to hand to a subprocess."""
        return {ENV_PREFIX + k.upper(): str(v) for k, v in dataclasses.asdict(self).items()}

    @property
    def home_path(self) -> Path:
        return Path(self.home).expanduser().resolve()

    def kafka_client_config(self) -> dict[str, Any]:
        """How every Kafka client of microbatch authenticates, in kafka-python's names
        (``KafkaConsumer(bootstrap_servers=..., **config)``; the JVM reader maps them to
        Java's): nothing for ``PLAINTEXT``."""
        protocol = self.kafka_security_protocol
        if protocol == "PLAINTEXT":
            return {}
        config: dict[str, Any] = {"security_protocol": protocol}
        if protocol.startswith("SASL_"):
            config["sasl_mechanism"] = self.kafka_sasl_mechanism
            config["sasl_plain_username"] = self.kafka_sasl_username
            config["sasl_plain_password"] = self.kafka_sasl_password
        if self.kafka_ssl_cafile and protocol.endswith("SSL"):
            config["ssl_cafile"] = self.kafka_ssl_cafile
        return config

    def boto3_client_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``boto3.client("s3", **kwargs)``."""
        kwargs: dict[str, Any] = {
            "aws_access_key_id": self.s3_access_key_id,
            "aws_secret_access_key": self.s3_secret_access_key,
            "region_name": self.s3_region,
        }
        if self.s3_endpoint_url:
            kwargs["endpoint_url"] = self.s3_endpoint_url
        return kwargs

    def pyarrow_s3_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``pyarrow.fs.S3FileSystem(**kwargs)``."""
        kwargs: dict[str, Any] = {
            "access_key": self.s3_access_key_id,
            "secret_key": self.s3_secret_access_key,
            "region": self.s3_region,
        }
        if self.s3_endpoint_url:
            url = urlparse(self.s3_endpoint_url)
            kwargs["endpoint_override"] = url.netloc
            kwargs["scheme"] = url.scheme
        return kwargs

    def redacted(self) -> dict[str, str]:
        """The settings with secrets masked: safe for logs, XCom and UI pages."""
        return {
            k: ("***" if k in _SECRET_FIELDS and v else str(v))
            for k, v in dataclasses.asdict(self).items()
        }

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in self.redacted().items())
        return f"Settings({fields})"
