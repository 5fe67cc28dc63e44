"""Jars from Maven Central: ``mvn dependency:copy-dependencies`` on a POM shipped with this
package. The Kafka broker and Spark's Kafka connector are resolved this way, offline-safe
once ``~/.m2`` holds them."""

from __future__ import annotations

import shutil
import subprocess
from importlib import resources
from pathlib import Path

from microbatch.errors import ServiceError


def copy_dependencies(
    what: str, pom: str, properties: dict[str, str], into: Path, expect: str
) -> None:
    """Resolve ``pom`` (a resource of ``microbatch.localstack``) with ``-D`` ``properties``
    into ``into``; :class:`ServiceError` naming ``what`` unless a jar matching ``expect``
    (a glob) arrived."""
    mvn = shutil.which("mvn")
    if not mvn:
        raise ServiceError(
            f"{what}: Maven (`mvn`) is not on PATH; it fetches the jars from Maven Central. "
            "Install it, e.g. `apt-get install -y maven`."
        )
    into.mkdir(parents=True, exist_ok=True)
    with resources.as_file(resources.files("microbatch.localstack").joinpath(pom)) as path:
        cmd = [mvn, "-B", "-q", "-f", str(path)]
        cmd += [f"-D{key}={value}" for key, value in properties.items()]
        cmd += ["dependency:copy-dependencies", "-DincludeScope=runtime",
                f"-DoutputDirectory={into}"]  # fmt: skip
        result = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if result.returncode != 0 or not any(into.glob(expect)):
        output = (result.stdout + result.stderr).strip().splitlines()[-12:]
        raise ServiceError(
            f"{what}: could not resolve it from Maven Central with mvn (is the repository "
            "reachable? a proxy in ~/.m2/settings.xml?).\n"
            + "\n".join("    " + line for line in output)
        )
