"""Apache Kafka (KRaft, one combined broker+controller) from Maven Central jars.

The jars are resolved with ``mvn dependency:copy-dependencies`` from the POM shipped next
to this module (``kafka_2.13`` plus the log4j2 binding its POM leaves out) into
``$MICROBATCH_HOME/kafka/libs-<version>``. Storage is formatted once with
``kafka.tools.StorageTool format --standalone``; the broker then runs ``kafka.Kafka``.
Internal topics (offsets, transaction state, share-coordinator state) use replication
factor 1 so transactions work on a single node. With ``sasl_users`` the broker also
listens with ``SASL_PLAINTEXT`` on the port after its controller's, for those users with
mechanisms ``PLAIN``, ``SCRAM-SHA-256`` and ``SCRAM-SHA-512`` (SCRAM credentials are
written when the storage is formatted): what the tests of secured-cluster settings
connect to.
"""

from __future__ import annotations

import base64
import os
import shutil
import subprocess
import uuid
from collections.abc import Mapping
from pathlib import Path

from microbatch.errors import ServiceError
from microbatch.localstack.maven import copy_dependencies
from microbatch.localstack.process import ServiceProcess, port_is_free, tail
from microbatch.settings import Settings

KAFKA_VERSION = "4.1.1"
CONTROLLER_PORT_OFFSET = 1
SASL_PORT_OFFSET = 2
SASL_MECHANISMS = ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512")

_LOG4J2 = """\
status = warn
appender.console.type = Console
appender.console.name = STDOUT
appender.console.layout.type = PatternLayout
appender.console.layout.pattern = [%d] %p %m (%c)%n
rootLogger.level = info
rootLogger.appenderRef.stdout.ref = STDOUT
logger.kafka.name = kafka
logger.kafka.level = warn
logger.apache.name = org.apache.kafka
logger.apache.level = warn
logger.server.name = kafka.server.KafkaRaftServer
logger.server.level = info
"""


def java_binary() -> str:
    java_home = os.environ.get("JAVA_HOME")
    candidate = Path(java_home, "bin", "java") if java_home else None
    found = str(candidate) if candidate and candidate.exists() else shutil.which("java")
    if not found:
        raise ServiceError(
            "Kafka: `java` was not found (JAVA_HOME unset or wrong, nothing on PATH). "
            "Install Java 17+, e.g. `apt-get install -y openjdk-17-jre-headless`."
        )
    return found


def broker_port(settings: Settings) -> int:
    first = settings.kafka_bootstrap_servers.split(",")[0].strip()
    host, _, port = first.rpartition(":")
    if host not in ("127.0.0.1", "localhost"):
        raise ServiceError(
            f"Kafka: MICROBATCH_KAFKA_BOOTSTRAP_SERVERS={settings.kafka_bootstrap_servers!r} "
            "is not on loopback; the local stack only starts a broker on 127.0.0.1. Unset it "
            "to use the embedded broker, or leave the local stack off for an external cluster."
        )
    return int(port)


def ensure_jars(home: Path) -> Path:
    """Resolve the broker's runtime classpath into ``home/kafka/libs-<version>`` (idempotent)."""
    libs = home / "kafka" / f"libs-{KAFKA_VERSION}"
    done = libs / ".complete"
    if done.exists():
        return libs
    copy_dependencies(
        f"Kafka (org.apache.kafka:kafka_2.13:{KAFKA_VERSION})",
        "kafka-pom.xml",
        {"kafka.version": KAFKA_VERSION},
        libs,
        "kafka_2.13-*.jar",
    )
    done.write_text(KAFKA_VERSION)
    return libs


def server_properties(
    port: int,
    controller_port: int,
    log_dir: Path,
    sasl_users: Mapping[str, str] | None = None,
) -> str:
    listeners = f"PLAINTEXT://127.0.0.1:{port}"
    protocols = "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT"
    sasl = ""
    if sasl_users:
        listeners += f",SASL_PLAINTEXT://127.0.0.1:{port + SASL_PORT_OFFSET}"
        protocols += ",SASL_PLAINTEXT:SASL_PLAINTEXT"
        users = " ".join(f'user_{name}="{pw}"' for name, pw in sorted(sasl_users.items()))
        scram = "org.apache.kafka.common.security.scram.ScramLoginModule required;"
        sasl = (
            f"sasl.enabled.mechanisms={','.join(SASL_MECHANISMS)}\n"
            "listener.name.sasl_plaintext.plain.sasl.jaas.config="
            f"org.apache.kafka.common.security.plain.PlainLoginModule required {users};\n"
            f"listener.name.sasl_plaintext.scram-sha-256.sasl.jaas.config={scram}\n"
            f"listener.name.sasl_plaintext.scram-sha-512.sasl.jaas.config={scram}\n"
        )
    return f"""\
process.roles=broker,controller
node.id=1
controller.quorum.bootstrap.servers=127.0.0.1:{controller_port}
listeners={listeners},CONTROLLER://127.0.0.1:{controller_port}
advertised.listeners={listeners}
controller.listener.names=CONTROLLER
inter.broker.listener.name=PLAINTEXT
listener.security.protocol.map={protocols}
{sasl}log.dirs={log_dir}
num.partitions=1
auto.create.topics.enable=false
offsets.topic.replication.factor=1
offsets.topic.num.partitions=5
transaction.state.log.replication.factor=1
transaction.state.log.min.isr=1
transaction.state.log.num.partitions=5
share.coordinator.state.topic.replication.factor=1
share.coordinator.state.topic.min.isr=1
group.initial.rebalance.delay.ms=0
log.cleaner.backoff.ms=1000
"""


def _kafka_uuid() -> str:
    """A cluster id in Kafka's format: URL-safe base64 of 16 random bytes, no padding.

    It may start with '-', so pass it as ``--cluster-id=<id>``, never as a separate argument.
    """
    return base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")


def _broker_answers(bootstrap: str) -> bool:
    from kafka import KafkaAdminClient  # local import: keep the stack CLI light

    # A short reconnect backoff: with the client's default, a probe that began before the
    # port opened sleeps seconds after the broker is up (its backoff grows while refused).
    admin = KafkaAdminClient(
        bootstrap_servers=bootstrap, request_timeout_ms=3000, reconnect_backoff_max_ms=250
    )
    try:
        admin.describe_cluster()
    finally:
        admin.close()
    return True


class KafkaBroker:
    """Start/stop one KRaft broker for ``settings`` with data under ``workdir``."""

    def __init__(
        self, settings: Settings, workdir: Path, sasl_users: Mapping[str, str] | None = None
    ) -> None:
        self.settings = settings
        self.workdir = workdir
        self.sasl_users = dict(sasl_users or {})
        self.process = ServiceProcess("kafka", workdir)

    def _format(self, java: str, classpath: str, config: Path, data: Path) -> None:
        if (data / "meta.properties").exists():
            return
        cmd = [java, "-cp", classpath, "kafka.tools.StorageTool", "format", "--standalone",
               f"--cluster-id={_kafka_uuid()}", "-c", str(config)]  # fmt: skip
        for name, password in sorted(self.sasl_users.items()):
            for mechanism in SASL_MECHANISMS[1:]:  # SCRAM users live in the cluster metadata
                cmd += ["--add-scram", f"{mechanism}=[name={name},password={password}]"]
        result = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if result.returncode != 0:
            raise ServiceError(
                f"Kafka: formatting KRaft storage in {data} failed (exit {result.returncode}):\n"
                f"    {(result.stdout + result.stderr).strip()[-1500:]}"
            )

    def start(self, timeout: float = 90.0) -> None:
        if self.process.pid() is not None:
            return
        port = broker_port(self.settings)
        controller_port = port + CONTROLLER_PORT_OFFSET
        ports = [port, controller_port] + ([port + SASL_PORT_OFFSET] if self.sasl_users else [])
        taken = [p for p in ports if not port_is_free(p)]
        if taken:
            raise ServiceError(
                f"Kafka: port(s) {taken} on 127.0.0.1 are in use (the broker needs {ports}: "
                "itself, its controller, its SASL listener). Stop whatever holds them (`make "
                "stack-down` if it is an old stack), or choose another port in "
                "MICROBATCH_KAFKA_BOOTSTRAP_SERVERS."
            )
        java = java_binary()
        libs = ensure_jars(self.settings.home_path)
        classpath = f"{libs}/*"
        data = self.workdir / "data"
        config = self.workdir / "server.properties"
        log4j = self.workdir / "log4j2.properties"
        self.workdir.mkdir(parents=True, exist_ok=True)
        config.write_text(server_properties(port, controller_port, data, self.sasl_users))
        log4j.write_text(_LOG4J2)
        self._format(java, classpath, config, data)
        argv = [java, "-Xms256m", "-Xmx512m", "-XX:+UseG1GC",
                f"-Dlog4j2.configurationFile={log4j}", "-Djava.awt.headless=true",
                "-cp", classpath, "kafka.Kafka", str(config)]  # fmt: skip
        self.process.start(
            argv,
            ready=lambda: _broker_answers(f"127.0.0.1:{port}"),
            timeout=timeout,
            hint=f"See {self.process.log_path}; `make stack-down` clears an old stack.",
        )

    def stop(self) -> bool:
        return self.process.stop()

    def log_tail(self) -> str:
        return tail(self.process.log_path)
