"""Fixtures of the integration tests: the broker's address and one admin client per module."""

from __future__ import annotations

from collections.abc import Iterator

import pytest


@pytest.fixture(scope="module")
def bootstrap(kafka_settings) -> str:
    return kafka_settings.kafka_bootstrap_servers


@pytest.fixture(scope="module")
def admin(bootstrap) -> Iterator:
    from kafka import KafkaAdminClient

    client = KafkaAdminClient(bootstrap_servers=bootstrap)
    yield client
    client.close()


@pytest.fixture(scope="session")
def postgres_dsn(postgres) -> str:
    """A database of the run's PostgreSQL for the PostgreSQL sink's tables."""
    postgres.create_database("sinks")
    return postgres.dsn("sinks")


@pytest.fixture(scope="module")
def pyiceberg_threads() -> Iterator[None]:
    """Stop pyiceberg's process-wide thread pool (non-daemon workers) after the module:
    the suite fails a run that leaves non-daemon threads behind."""
    from pyiceberg.utils.concurrent import ExecutorFactory

    yield
    if ExecutorFactory._instance is not None:
        ExecutorFactory._instance.shutdown(wait=True)
        ExecutorFactory._instance = None
