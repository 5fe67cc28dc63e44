"""Apache Iceberg's Java runtime (``iceberg-spark-runtime``) and the SQLite JDBC driver from
Maven Central, so a JVM can read the Iceberg sink's tables with Iceberg's own Java code.

The sink writes with pyiceberg; the integration test reads the table back in a JVM through
Iceberg's ``JdbcCatalog`` (the same catalog tables as pyiceberg's SQL catalog, here the
SQLite file) and its generic reader. Each ``iceberg-spark-runtime-<spark>_2.13`` is built
for one Spark minor: Iceberg 1.12.0 ships 4.1 (and 4.0 up to 1.11.0), none for Spark 4.2
yet, and the 4.1 connector fails on Spark 4.2 (``IncompatibleClassChangeError``: Spark 4.2
turned ``CatalogManager`` and ``View`` into interfaces). The shaded jar still holds Iceberg's
core, data and JDBC catalog classes, which run in any JVM, Spark 4.2's included.

:func:`ensure_iceberg_jars` downloads (once, into ``$MICROBATCH_HOME/iceberg/jars-<v>``);
:func:`iceberg_jars` only looks.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from microbatch.errors import ServiceError

ICEBERG_VERSION = "1.12.0"
SQLITE_JDBC_VERSION = "3.54.1.0"
ARTIFACTS = (
    f"org.apache.iceberg:iceberg-spark-runtime-4.1_2.13:{ICEBERG_VERSION}",
    f"org.xerial:sqlite-jdbc:{SQLITE_JDBC_VERSION}",
)
_DONE = ".complete"


def jar_dir(home: Path) -> Path:
    return Path(home).resolve() / "iceberg" / f"jars-{ICEBERG_VERSION}"


def iceberg_jars(home: Path) -> list[Path]:
    """The jars, or ``[]`` if they have not been fetched. Never downloads."""
    libs = jar_dir(home)
    return sorted(libs.glob("*.jar")) if (libs / _DONE).exists() else []


def ensure_iceberg_jars(home: Path) -> list[Path]:
    """Fetch the jars with ``mvn dependency:copy`` (idempotent); their paths."""
    found = iceberg_jars(home)
    if found:
        return found
    mvn = shutil.which("mvn")
    if not mvn:
        raise ServiceError(
            "Iceberg's Java runtime: Maven (`mvn`) is not on PATH; it fetches the jars from "
            "Maven Central. Install it, e.g. `apt-get install -y maven`."
        )
    libs = jar_dir(home)
    shutil.rmtree(libs, ignore_errors=True)
    libs.mkdir(parents=True)
    for artifact in ARTIFACTS:
        cmd = [mvn, "-B", "-q", "dependency:copy", f"-Dartifact={artifact}",
               f"-DoutputDirectory={libs}"]  # fmt: skip
        result = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if result.returncode != 0:
            tail = (result.stdout + result.stderr).strip().splitlines()[-8:]
            raise ServiceError(
                f"could not fetch {artifact} from Maven Central with mvn (is it reachable? "
                "a proxy in ~/.m2/settings.xml?):\n" + "\n".join("    " + t for t in tail)
            )
    (libs / _DONE).write_text(ICEBERG_VERSION)
    return sorted(libs.glob("*.jar"))
