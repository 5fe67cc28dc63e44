"""Spark's Kafka data source (``spark-sql-kafka-0-10``) from Maven Central.

pyspark ships without it, yet stage 1 reads planned offset ranges fastest with it (see
``microbatch.kafka.spark_source``) and the pipeline bench needs it for its Structured
Streaming reference. ``mvn dependency:copy-dependencies`` resolves the POM shipped next to
this module, for the installed pyspark's version, into
``$MICROBATCH_HOME/spark-kafka/jars-<version>``; jars pyspark already ships (another
version of one library) are dropped, so the classpath never holds two versions.

:func:`ensure_spark_kafka_jars` downloads (``make jars``); looking them up is the runtime's
:func:`microbatch.spark_jars.spark_kafka_jars`, so starting a session never runs Maven and
the runtime never needs this distribution. A resolution records the POM's digest in its
marker, so a changed POM is resolved again by the next ``make jars``.
"""

from __future__ import annotations

import hashlib
import importlib.util
import re
import shutil
from importlib import resources
from pathlib import Path

from microbatch.localstack.maven import copy_dependencies
from microbatch.spark_jars import COMPLETE, jar_dir, pyspark_version

POM = "spark-kafka-pom.xml"
_VERSION = re.compile(r"\d+\.\d+")


def _stamp(version: str) -> str:
    """What a complete resolution records: the Spark version and the POM's digest."""
    pom = resources.files("microbatch.localstack").joinpath(POM).read_bytes()
    return f"{version} {hashlib.sha256(pom).hexdigest()[:16]}"


def ensure_spark_kafka_jars(home: Path) -> list[Path]:
    """Resolve the connector for the installed pyspark (idempotent) and return its jars."""
    version = pyspark_version()
    libs = jar_dir(home, version)
    done = libs / COMPLETE
    if done.exists() and done.read_text() == _stamp(version):
        return sorted(libs.glob("*.jar"))
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
    (libs / COMPLETE).write_text(_stamp(version))
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
