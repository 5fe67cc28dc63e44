"""Session-wide fixtures: one Kafka broker, one SeaweedFS, one PostgreSQL, one SparkSession
and one Spark Connect server per test run.

Services start lazily, only when a test asks for them, on free loopback ports, with data
in a temporary folder; they stop when the run ends. To run the suite against services you
already have (a real cluster, AWS S3), export ``MICROBATCH_KAFKA_BOOTSTRAP_SERVERS`` and/or
``MICROBATCH_S3_ENDPOINT_URL`` (plus keys and bucket): the fixtures then start nothing.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from microbatch.localstack import KafkaBroker, SeaweedFS
from microbatch.localstack.kafka import SASL_PORT_OFFSET
from microbatch.localstack.postgres import PostgresServer
from microbatch.localstack.process import free_port_block
from microbatch.localstack.seaweedfs import ALL_OFFSETS
from microbatch.localstack.spark_connect import SparkConnectServer
from microbatch.settings import Settings

REPO = Path(__file__).resolve().parents[1]
EXTERNAL_KAFKA = "MICROBATCH_KAFKA_BOOTSTRAP_SERVERS" in os.environ
EXTERNAL_S3 = "MICROBATCH_S3_ENDPOINT_URL" in os.environ
#: The user the run's broker accepts on its SASL_PLAINTEXT listener (``sasl_settings``).
SASL_USER = ("microbatch-test", "test-secret-pw")


@pytest.fixture(scope="session")
def stack_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("stack")


@pytest.fixture(scope="session")
def test_settings() -> Settings:
    """Settings for this run: external services from the env, else free loopback ports."""
    overrides: dict[str, str] = {"home": os.environ.get("MICROBATCH_HOME", str(REPO / ".local"))}
    if not EXTERNAL_KAFKA:
        port = free_port_block([0, 1, SASL_PORT_OFFSET])
        overrides["kafka_bootstrap_servers"] = f"127.0.0.1:{port}"
    if not EXTERNAL_S3:
        port = free_port_block(ALL_OFFSETS)
        overrides["s3_endpoint_url"] = f"http://127.0.0.1:{port}"
    overrides.setdefault("spark_master", os.environ.get("MICROBATCH_SPARK_MASTER", "local[2]"))
    return Settings.from_env(**overrides)


@pytest.fixture(scope="session")
def kafka_settings(test_settings: Settings, stack_dir: Path) -> Iterator[Settings]:
    """Settings whose ``kafka_bootstrap_servers`` answer (a broker started for this run)."""
    if EXTERNAL_KAFKA:
        yield test_settings
        return
    broker = KafkaBroker(test_settings, stack_dir / "kafka", sasl_users=dict([SASL_USER]))
    broker.start()
    yield test_settings
    broker.stop()


@pytest.fixture(scope="session")
def sasl_settings(kafka_settings: Settings) -> Settings:
    """The same broker through its SASL_PLAINTEXT listener, as a secured cluster's user."""
    if EXTERNAL_KAFKA:
        pytest.skip("the run's own broker has the SASL listener; an external one may not")
    host, _, port = kafka_settings.kafka_bootstrap_servers.rpartition(":")
    return dataclasses.replace(
        kafka_settings,
        kafka_bootstrap_servers=f"{host}:{int(port) + SASL_PORT_OFFSET}",
        kafka_security_protocol="SASL_PLAINTEXT",
        kafka_sasl_username=SASL_USER[0],
        kafka_sasl_password=SASL_USER[1],
    )


@pytest.fixture(scope="session")
def s3_settings(test_settings: Settings, stack_dir: Path) -> Iterator[Settings]:
    """Settings whose S3 endpoint answers and whose bucket exists."""
    if EXTERNAL_S3:
        yield test_settings
        return
    store = SeaweedFS(test_settings, stack_dir / "seaweedfs")
    store.start()
    yield test_settings
    store.stop()


@pytest.fixture(scope="session")
def stack_settings(kafka_settings: Settings, s3_settings: Settings) -> Settings:
    """Both Kafka and S3 are up."""
    return kafka_settings


@pytest.fixture(scope="session")
def postgres() -> Iterator[PostgresServer]:
    """The run's PostgreSQL server (Airflow's metadata databases), on a free port.

    Its folder is a fresh one under the system's temp dir rather than pytest's (which only
    root may enter): run as root, the server runs as the ``postgres`` account. Not durable
    (no fsync): a test run never outlives its machine.
    """
    workdir = Path(tempfile.mkdtemp(prefix="microbatch-postgres-"))
    server = PostgresServer(free_port_block([0]), workdir, durable=False)
    server.start()
    yield server
    server.stop()
    shutil.rmtree(workdir, ignore_errors=True)


@pytest.fixture(scope="session")
def spark_connect(stack_dir: Path) -> Iterator[SparkConnectServer]:
    """The run's warm Spark Connect server (executors ``local[2]``): the warm-mode tests and
    the Airflow batches of the e2e tests run on it, as ``make airflow``'s do."""
    server = SparkConnectServer(free_port_block([0]), stack_dir / "spark-connect", "local[2]")
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def spark(test_settings: Settings):
    """The one SparkSession of the test run (start-up costs ~10 s)."""
    from microbatch.spark import spark_session

    # py4j says "Closing down clientserver connection" at INFO from __del__ at interpreter
    # exit, into handlers (Airflow's, set up on import) whose streams pytest has closed.
    logging.getLogger("py4j").setLevel(logging.WARNING)
    session = spark_session(test_settings, app_name="microbatch-tests")
    yield session
    session.stop()


@pytest.fixture
def s3_client(s3_settings: Settings):
    import boto3

    return boto3.client("s3", **s3_settings.boto3_client_kwargs())


def _lingering_threads(grace_seconds: float = 5.0) -> list[str]:
    others = [t for t in threading.enumerate() if t is not threading.main_thread() and not t.daemon]
    for thread in others:
        thread.join(timeout=grace_seconds / max(len(others), 1))
    return [t.name for t in others if t.is_alive()]


def pytest_unconfigure(config: pytest.Config) -> None:
    """Fail loudly instead of hanging when a test leaves a non-daemon thread running.

    An unclosed kafka-python client reconnects forever once the broker has stopped and
    keeps the interpreter alive, which would turn a green run into a CI timeout.
    """
    leaked = _lingering_threads()
    if leaked:
        sys.stderr.write(
            f"\nERROR: the test run left non-daemon threads running: {leaked}. A client "
            "(Kafka producer/consumer/admin?) was not closed. Failing instead of hanging.\n"
        )
        sys.stderr.flush()
        os._exit(3)
