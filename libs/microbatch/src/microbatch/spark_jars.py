"""Spark's Kafka connector jars where ``make jars`` resolved them: looks, never downloads.

Sessions (:func:`microbatch.spark.with_kafka_connector`) and spark-submit
(:mod:`microbatch.submit`) put them on the classpath when they are there, so stage 1 reads
Kafka with the JVM source. Resolving them takes Maven and a POM, which belong to the local
stack (``microbatch.localstack.spark_kafka`` in the microbatch-dev distribution, or the
Airflow image's build): it writes the jars into :func:`jar_dir` and, last, a marker file
whose first word is the pyspark version they were resolved for. Until the marker is there,
a resolution is incomplete and no jar of it is used.
"""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

from microbatch.errors import ServiceError

#: The marker a complete resolution writes last: ``<pyspark version> <resolver's stamp>``.
COMPLETE = ".complete"


def pyspark_version() -> str:
    """The installed pyspark's version (read from its metadata, without importing it)."""
    try:
        return importlib.metadata.version("pyspark")
    except importlib.metadata.PackageNotFoundError:
        raise ServiceError(
            "the Spark Kafka connector jars match pyspark's version, but pyspark is not "
            "installed: run `make venv` (or pip install 'microbatch[spark]')"
        ) from None


def jar_dir(home: Path, version: str | None = None) -> Path:
    """Where the connector jars for ``version`` (default: the installed pyspark's) live; an
    absolute path (mvn would read a relative one from the POM's folder, Spark from its
    working directory)."""
    return Path(home).resolve() / "spark-kafka" / f"jars-{version or pyspark_version()}"


def spark_kafka_jars(home: Path) -> list[Path]:
    """The resolved connector jars for the installed pyspark, or ``[]`` if ``make jars``
    has not resolved them (or pyspark is missing). Never downloads."""
    try:
        version = pyspark_version()
    except ServiceError:
        return []
    libs = jar_dir(home, version)
    done = libs / COMPLETE
    if not done.exists() or done.read_text().split(" ")[0] != version:
        return []
    return sorted(libs.glob("*.jar"))
