"""Delta Lake's Spark connector (``io.delta:delta-spark_2.13``) from Maven Central.

The Delta sink writes with delta-rs; the jars let Spark read its tables with Delta's own
reader (the integration tests do, and docs/delta.md shows how). Each Delta release is built
against one Spark minor version (its POM's ``spark-sql`` dependency): 4.0.0 for Spark 4.0,
4.1.0–4.3.0 for Spark 4.1, 4.4.0 for Spark 4.2. ``mvn dependency:copy-dependencies``
resolves the POM shipped next to this module into
``$MICROBATCH_HOME/delta-spark/jars-<delta version>`` (the connector and
``delta-storage``; jars pyspark already ships are dropped).

:func:`ensure_delta_jars` downloads (``make jars``); :func:`delta_jars` only looks. The
shared test session does not load them: a Delta session needs its SQL extension and
catalog, so readers start their own (``spark_conf`` lists what to pass).
"""

from __future__ import annotations

import shutil
from pathlib import Path

from microbatch.errors import ServiceError
from microbatch.localstack.maven import copy_dependencies
from microbatch.localstack.spark_kafka import _pyspark_artifacts, artifact_name
from microbatch.spark_jars import pyspark_version

POM = "delta-spark-pom.xml"
_DONE = ".complete"
#: Spark minor version → the newest Delta release built against it.
DELTA_FOR_SPARK = {"4.0": "4.0.0", "4.1": "4.3.0", "4.2": "4.4.0"}


def delta_version(spark_version: str | None = None) -> str:
    """The Delta release for ``spark_version`` (default: the installed pyspark's)."""
    spark = spark_version or pyspark_version()
    minor = ".".join(spark.split(".")[:2])
    try:
        return DELTA_FOR_SPARK[minor]
    except KeyError:
        raise ServiceError(
            f"no Delta Lake release is known for Spark {spark} (known: "
            f"{', '.join(sorted(DELTA_FOR_SPARK))}); add the delta-spark version built "
            "for it (its POM's spark-sql dependency) to DELTA_FOR_SPARK"
        ) from None


def jar_dir(home: Path, version: str) -> Path:
    return Path(home).resolve() / "delta-spark" / f"jars-{version}"


def delta_jars(home: Path) -> list[Path]:
    """The resolved jars for the installed pyspark, or ``[]`` if ``make jars`` has not
    fetched them. Never downloads."""
    try:
        version = delta_version()
    except ServiceError:
        return []
    libs = jar_dir(home, version)
    if not (libs / _DONE).exists():
        return []
    return sorted(libs.glob("*.jar"))


def ensure_delta_jars(home: Path) -> list[Path]:
    """Resolve the Delta connector for the installed pyspark (idempotent); its jars."""
    found = delta_jars(home)
    if found:
        return found
    version = delta_version()
    libs = jar_dir(home, version)
    shutil.rmtree(libs, ignore_errors=True)
    copy_dependencies(
        f"Delta Lake for Spark (io.delta:delta-spark_2.13:{version})",
        POM,
        {"delta.version": version},
        libs,
        "delta-spark_*.jar",
    )
    shipped = _pyspark_artifacts()
    for jar in libs.glob("*.jar"):
        if artifact_name(jar.name) in shipped:
            jar.unlink()
    (libs / _DONE).write_text(version)
    return sorted(libs.glob("*.jar"))


def spark_conf(jars: list[Path]) -> dict[str, str]:
    """What a SparkSession needs to read and write Delta tables with these jars."""
    return {
        "spark.jars": ",".join(str(j) for j in jars),
        "spark.sql.extensions": "io.delta.sql.DeltaSparkSessionExtension",
        "spark.sql.catalog.spark_catalog": "org.apache.spark.sql.delta.catalog.DeltaCatalog",
    }
