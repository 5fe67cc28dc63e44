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
- ``MICROBATCH_KAFKA_TIMEOUT_S``: how long the driver waits for the brokers when it plans
  a batch (metadata, offsets) before the batch fails; a wrong password or an unreachable
  cluster fails after it; ``30``
- ``MICROBATCH_S3_ENDPOINT_URL``: S3 API endpoint, empty for AWS; ``http://127.0.0.1:8333``
- ``MICROBATCH_S3_ACCESS_KEY_ID`` / ``MICROBATCH_S3_SECRET_ACCESS_KEY``: S3 keys (the
  secret is never logged); empty = see *S3 credentials* below
- ``MICROBATCH_S3_REGION``: region name; ``us-east-1``
- ``MICROBATCH_S3_BUCKET``: bucket for checkpoints and outputs; ``microbatch``
- ``MICROBATCH_SPARK_MASTER``: Spark master URL (``local[*]``, ``spark://host:7077``,
  ``k8s://...``, ``yarn``); ``local[*]``
- ``MICROBATCH_SPARK_LOG_LEVEL``: the level of Spark's own log (the JVM's log4j) in a
  batch's output — the CLI's, the Airflow task log: ``WARN`` (``INFO`` shows Spark's
  start-up and stage chatter, ``ERROR`` less); ``WARN``
- ``MICROBATCH_HOME``: local folder for downloaded jars and service data; ``./.local``
- ``MICROBATCH_STATE_CACHE_DIR``: local folder where executors keep fetched state blocks
  between batches (``off``: none); empty = ``microbatch-state-cache`` in the temp dir
- ``MICROBATCH_STATE_CACHE_MEMORY_MB``: decoded state blocks kept in memory per Python
  worker; ``256``
- ``MICROBATCH_STATE_CACHE_DISK_MB``: the state cache folder's size beyond which the
  least recently fetched runs' blocks are dropped; ``10240``

S3 credentials, first that applies:

1. both ``MICROBATCH_S3_ACCESS_KEY_ID`` and ``MICROBATCH_S3_SECRET_ACCESS_KEY`` (or the
   Airflow connection's login/password);
2. the embedded local stack — the S3 endpoint is on loopback and the environment names
   no AWS credentials (none of :data:`AWS_CREDENTIAL_VARIABLES`) — its keys
   ``microbatch`` / ``microbatch-secret``, which SeaweedFS is started with;
3. otherwise boto3's default credential chain, and the same chain of pyarrow's
   ``S3FileSystem``: ``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY`` (+
   ``AWS_SESSION_TOKEN``), ``AWS_PROFILE`` in the shared credentials file
   (``AWS_SHARED_CREDENTIALS_FILE``, default ``~/.aws/credentials``), web identity,
   container and instance-profile roles.

``MICROBATCH_ENV=production`` (default ``development``) refuses the local stack's
defaults: the local keys, and loopback Kafka or S3 endpoints, each a :class:`ConfigError`
naming the variable.
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
#: ``development`` (the default) or ``production`` (no local-stack defaults accepted).
ENV_VARIABLE = "MICROBATCH_ENV"
ENVIRONMENTS = ("development", "production")
#: The keys the embedded SeaweedFS is started with (``microbatch.localstack``).
LOCAL_STACK_S3_KEYS = ("microbatch", "microbatch-secret")
#: Variables that hand boto3's (and pyarrow's) default chain its credentials: when any is
#: set, a loopback endpoint is not assumed to be the local stack's.
AWS_CREDENTIAL_VARIABLES = (
    "AWS_ACCESS_KEY_ID",
    "AWS_PROFILE",
    "AWS_DEFAULT_PROFILE",
    "AWS_SHARED_CREDENTIALS_FILE",
    "AWS_WEB_IDENTITY_TOKEN_FILE",
    "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
    "AWS_CONTAINER_CREDENTIALS_FULL_URI",
)
_LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "::1", "0.0.0.0"})
_SECRET_FIELDS = frozenset({"s3_secret_access_key", "kafka_sasl_password", "postgres_dsn"})
KAFKA_SECURITY_PROTOCOLS = ("PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL")
KAFKA_SASL_MECHANISMS = ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512")
SPARK_LOG_LEVELS = ("ERROR", "WARN", "INFO", "DEBUG")
#: kafka-python consumer settings a source may tune (``KafkaSource(consumer_config=...)``):
#: each has a Java consumer setting of the same meaning and words (``fetch_max_wait_ms`` →
#: ``fetch.max.wait.ms``), so both readers take them.
KAFKA_TUNABLE = frozenset(
    {
        "client_id",
        "client_rack",
        "connections_max_idle_ms",
        "fetch_max_bytes",
        "fetch_max_wait_ms",
        "fetch_min_bytes",
        "max_partition_fetch_bytes",
        "max_poll_records",
        "metadata_max_age_ms",
        "receive_buffer_bytes",
        "reconnect_backoff_max_ms",
        "reconnect_backoff_ms",
        "request_timeout_ms",
        "retry_backoff_ms",
        "send_buffer_bytes",
    }
)


@dataclasses.dataclass(frozen=True)
class Settings:
    """Where the services are. Build with :meth:`from_env`; immutable afterwards."""

    kafka_bootstrap_servers: str = "127.0.0.1:9092"
    kafka_security_protocol: str = "PLAINTEXT"
    kafka_sasl_mechanism: str = "PLAIN"
    kafka_sasl_username: str = ""
    kafka_sasl_password: str = ""
    kafka_ssl_cafile: str = ""
    kafka_timeout_s: float = 30.0
    s3_endpoint_url: str = "http://127.0.0.1:8333"
    s3_access_key_id: str = ""
    s3_secret_access_key: str = ""
    s3_region: str = "us-east-1"
    s3_bucket: str = "microbatch"
    spark_master: str = "local[*]"
    spark_log_level: str = "WARN"
    home: str = ".local"
    state_cache_dir: str = ""
    state_cache_memory_mb: int = 256
    state_cache_disk_mb: int = 10240
    #: The PostgreSQL sinks' database when a sink names none (a libpq DSN or URI; it may
    #: hold a password, so it is masked like the other secrets).
    postgres_dsn: str = ""

    def __post_init__(self) -> None:
        for name in ("state_cache_memory_mb", "state_cache_disk_mb"):
            raw = getattr(self, name)
            try:
                mib = int(raw)
            except (TypeError, ValueError):
                mib = -1
            if mib < 0:
                raise ConfigError(
                    f"MICROBATCH_{name.upper()}={raw!r}: expected a whole number of MiB (0 or more)"
                )
            object.__setattr__(self, name, mib)
        try:
            timeout = float(self.kafka_timeout_s)
        except (TypeError, ValueError):
            timeout = -1.0
        if not 0 < timeout < float("inf"):
            raise ConfigError(
                f"MICROBATCH_KAFKA_TIMEOUT_S={self.kafka_timeout_s!r}: expected seconds, more "
                "than 0 (e.g. 30)"
            )
        object.__setattr__(self, "kafka_timeout_s", timeout)
        level = str(self.spark_log_level).upper()
        if level not in SPARK_LOG_LEVELS:
            raise ConfigError(
                f"MICROBATCH_SPARK_LOG_LEVEL={self.spark_log_level!r}: expected one of "
                f"{', '.join(SPARK_LOG_LEVELS)}"
            )
        object.__setattr__(self, "spark_log_level", level)
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
        if bool(self.s3_access_key_id) != bool(self.s3_secret_access_key):
            pair = ("ACCESS_KEY_ID", "SECRET_ACCESS_KEY")
            given, missing = pair if self.s3_access_key_id else pair[::-1]
            raise ConfigError(
                f"MICROBATCH_S3_{given} is set but MICROBATCH_S3_{missing} is not: set both, "
                "or neither to use the AWS default credential chain (AWS_ACCESS_KEY_ID, "
                "AWS_PROFILE, an instance profile, ...)"
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

        Keyword arguments win over the environment; unknown names are an error. Unset S3
        keys become the local stack's on a loopback endpoint when ``env`` names no AWS
        credentials, and stay empty (the AWS default chain) otherwise; with
        ``MICROBATCH_ENV=production`` the result must pass :meth:`check_production`.
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
        endpoint = values.get("s3_endpoint_url", cls.s3_endpoint_url)
        if is_loopback_url(endpoint) and not any(env.get(v) for v in AWS_CREDENTIAL_VARIABLES):
            # The embedded local stack: SeaweedFS runs with these keys.
            for name, key in zip(("s3_access_key_id", "s3_secret_access_key"),
                                 LOCAL_STACK_S3_KEYS, strict=True):  # fmt: skip
                values[name] = values.get(name) or key
        settings = cls(**values)
        environment = env.get(ENV_VARIABLE, "") or "development"
        if environment not in ENVIRONMENTS:
            raise ConfigError(
                f"{ENV_VARIABLE}={environment!r}: expected one of {', '.join(ENVIRONMENTS)}"
            )
        if environment == "production":
            settings.check_production()
        return settings

    def check_production(self) -> None:
        """Refuse what only the embedded local stack should use (``MICROBATCH_ENV=
        production``): its S3 keys, and Kafka or S3 endpoints on loopback."""
        if self.s3_access_key_id == LOCAL_STACK_S3_KEYS[0] or (
            self.s3_secret_access_key == LOCAL_STACK_S3_KEYS[1]
        ):
            raise ConfigError(
                "MICROBATCH_S3_ACCESS_KEY_ID / MICROBATCH_S3_SECRET_ACCESS_KEY hold the local "
                f"stack's keys, refused with {ENV_VARIABLE}=production: set the real keys, or "
                "unset both and give the AWS default chain its credentials (AWS_ACCESS_KEY_ID, "
                "AWS_PROFILE, an instance profile)"
            )
        if is_loopback_url(self.s3_endpoint_url):
            raise ConfigError(
                f"MICROBATCH_S3_ENDPOINT_URL={self.s3_endpoint_url!r} is a loopback address, "
                f"refused with {ENV_VARIABLE}=production: set your S3 / MinIO URL (empty for AWS)"
            )
        loopback = [
            server
            for server in self.kafka_bootstrap_servers.split(",")
            if server.strip().rpartition(":")[0].strip("[]") in _LOOPBACK_HOSTS
        ]
        if loopback:
            raise ConfigError(
                f"MICROBATCH_KAFKA_BOOTSTRAP_SERVERS={self.kafka_bootstrap_servers!r} names "
                f"loopback broker(s) {loopback}, refused with {ENV_VARIABLE}=production: set "
                "your cluster's brokers"
            )

    @property
    def s3_credentials_source(self) -> str:
        """Where the S3 credentials come from, for messages (never the keys themselves)."""
        if (self.s3_access_key_id, self.s3_secret_access_key) == LOCAL_STACK_S3_KEYS:
            return "the local stack's keys (microbatch / microbatch-secret)"
        if self.s3_access_key_id:
            return f"MICROBATCH_S3_ACCESS_KEY_ID={self.s3_access_key_id!r} and its secret"
        return (
            "the AWS default credential chain (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, "
            "AWS_PROFILE and the shared credentials file, an instance profile)"
        )

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

    def kafka_client_config(self, tuning: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """How every Kafka client of microbatch authenticates, in kafka-python's names
        (``KafkaConsumer(bootstrap_servers=..., **config)``; the JVM reader maps them to
        Java's): nothing for ``PLAINTEXT``. ``tuning``: a source's own consumer settings
        (``KafkaSource.consumer_config``, checked to hold no security), added to them."""
        config: dict[str, Any] = dict(tuning or {})
        protocol = self.kafka_security_protocol
        if protocol == "PLAINTEXT":
            return config
        config["security_protocol"] = protocol
        if protocol.startswith("SASL_"):
            config["sasl_mechanism"] = self.kafka_sasl_mechanism
            config["sasl_plain_username"] = self.kafka_sasl_username
            config["sasl_plain_password"] = self.kafka_sasl_password
        if self.kafka_ssl_cafile and protocol.endswith("SSL"):
            config["ssl_cafile"] = self.kafka_ssl_cafile
        return config

    def boto3_client_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``boto3.client("s3", **kwargs)``: without keys, boto3's
        default credential chain finds them."""
        kwargs: dict[str, Any] = {"region_name": self.s3_region}
        if self.s3_access_key_id:
            kwargs["aws_access_key_id"] = self.s3_access_key_id
            kwargs["aws_secret_access_key"] = self.s3_secret_access_key
        if self.s3_endpoint_url:
            kwargs["endpoint_url"] = self.s3_endpoint_url
        return kwargs

    def pyarrow_s3_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``pyarrow.fs.S3FileSystem(**kwargs)``: without keys, the
        AWS SDK's default credential chain finds them."""
        kwargs: dict[str, Any] = {"region": self.s3_region}
        if self.s3_access_key_id:
            kwargs["access_key"] = self.s3_access_key_id
            kwargs["secret_key"] = self.s3_secret_access_key
        if self.s3_endpoint_url:
            url = urlparse(self.s3_endpoint_url)
            kwargs["endpoint_override"] = url.netloc
            kwargs["scheme"] = url.scheme
        return kwargs

    def s3_client_key(self) -> tuple[Any, ...]:
        """What decides an S3 client's identity: its kwargs, plus — for the default chain —
        the AWS variables it reads, so a changed environment gets a new client."""
        kwargs = tuple(sorted(self.boto3_client_kwargs().items()))
        if self.s3_access_key_id:
            return kwargs
        names = (*AWS_CREDENTIAL_VARIABLES, "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")
        return kwargs + tuple((name, os.environ.get(name)) for name in names)

    def secret_values(self) -> list[str]:
        """The values of the secret settings that are set (S3 secret key, Kafka SASL
        password, the PostgreSQL DSN and its password): what a host such as Airflow must
        mask wherever it shows text."""
        values = [str(getattr(self, n)) for n in sorted(_SECRET_FIELDS) if getattr(self, n)]
        password = dsn_password(self.postgres_dsn)
        return [*values, password] if password else values

    def redacted(self) -> dict[str, str]:
        """The settings with secrets masked: safe for logs, XCom and UI pages."""
        return {
            k: ("***" if k in _SECRET_FIELDS and v else str(v))
            for k, v in dataclasses.asdict(self).items()
        }

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in self.redacted().items())
        return f"Settings({fields})"


def dsn_password(dsn: str) -> str:
    """The password a libpq DSN or URI holds ("" if none or unparsable)."""
    if not dsn:
        return ""
    try:
        from psycopg.conninfo import conninfo_to_dict

        return str(conninfo_to_dict(dsn).get("password") or "")
    except Exception:  # a DSN psycopg cannot parse: the sink reports it when it connects
        return ""


def is_loopback_url(url: str) -> bool:
    """Is ``url``'s host this machine (where the embedded local stack listens)?"""
    return bool(url) and (urlparse(url).hostname or "") in _LOOPBACK_HOSTS
