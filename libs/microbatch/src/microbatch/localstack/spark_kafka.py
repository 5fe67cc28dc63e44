"""Spark's Kafka data source (``spark-sql-kafka-0-10``) from Maven Central.

pyspark ships without it, yet stage 1 reads planned offset ranges fastest with it (see
``microbatch.kafka.spark_source``) and the pipeline bench needs it for its Structured
Streaming reference. ``mvn dependency:copy-dependencies`` resolves the POM shipped next to
this module, for the installed pyspark's version, into
``$MICROBATCH_HOME/spark-kafka/jars-<version>``; jars pyspark already ships (another
version of one library) are dropped, so the classpath never holds two versions.

:func:`ensure_spark_kafka_jars` downloads (``make jars``); :func:`spark_kafka_jars` only
looks, so starting a session never runs Maven.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import re
import shutil
from importlib import resources
from pathlib import Path

from microbatch.errors import ServiceError
from microbatch.localstack.maven import copy_dependencies

POM = "spark-kafka-pom.xml"
_DONE = ".complete"
_VERSION = re.compile(r"\d+\.\d+")


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


def _stamp(version: str) -> str:
    """What a complete resolution records: the POM's digest and the Spark version."""
    pom = resources.files("microbatch.localstack").joinpath(POM).read_bytes()
    return f"{version} {hashlib.sha256(pom).hexdigest()[:16]}"


def spark_kafka_jars(home: Path) -> list[Path]:
    """The resolved connector jars for the installed pyspark, or ``[]`` if ``make jars``
    has not resolved them (or pyspark is missing). Never downloads."""
    try:
        version = pyspark_version()
    except ServiceError:
        return []
    libs = jar_dir(home, version)
    done = libs / _DONE
    if not done.exists() or done.read_text() != _stamp(version):
        return []
    return sorted(libs.glob("*.jar"))


def ensure_spark_kafka_jars(home: Path) -> list[Path]:
    """Resolve the connector for the installed pyspark (idempotent) and return its jars."""
    version = pyspark_version()
    found = spark_kafka_jars(home)
    if found:
        return found
    libs = jar_dir(home, version)
    shutil.rmtree(libs, ignore_errors=True)
    copy_dependencies(
        f"Spark Kafka connector (org.apache.spark:spark-sql-kafka-0-10_2.13:{version})",
        POM,
        {"spark.version": version},
        libs,
        "spark-sql-kafka-0-10_*.jar",
    )
    shipped = _pyspark_artifacts()
    for jar in libs.glob("*.jar"):
        if artifact_name(jar.name) in shipped:  # never two versions of one library
            jar.unlink()
    (libs / _DONE).write_text(_stamp(version))
    return sorted(libs.glob("*.jar"))


def _pyspark_artifacts() -> set[str]:
    """Artifact names of the jars pyspark ships (``pyspark/jars``)."""
    spec = importlib.util.find_spec("pyspark")  # locates the package without importing it
    roots = list(spec.submodule_search_locations or ()) if spec else []
    return {artifact_name(p.name) for root in roots for p in Path(root, "jars").glob("*.jar")}


def artifact_name(jar_name: str) -> str:
    """A jar file's artifact, without its version (from the first ``<digits>.<digits>``
    segment on; ``0-10_2.13`` is part of the name).

    >>> artifact_name("spark-sql-kafka-0-10_2.13-4.2.0.jar"), artifact_name("zstd-jni-1.5.6-10.jar")
    ('spark-sql-kafka-0-10_2.13', 'zstd-jni')
    """
    parts = jar_name.removesuffix(".jar").split("-")
    for i, part in enumerate(parts[1:], start=1):
        if _VERSION.match(part):
            return "-".join(parts[:i])
    return "-".join(parts)
