"""Building the SparkSession the same way for jobs, tests and the demo.

``MICROBATCH_SPARK_MASTER`` decides the engine: ``local[*]``, a cluster
(``spark://``, ``k8s://``, ``yarn``) or a warm Spark Connect server (``sc://host:port``).

Workers must run the driver's interpreter (the venv's Python): otherwise they pick up
``python3`` from PATH and fail with "No module named pyarrow". pyspark is imported
lazily so the rest of the library works without it.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING

from microbatch.settings import Settings

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

DEFAULT_CONF: dict[str, str] = {
    "spark.sql.execution.arrow.pyspark.enabled": "true",
    "spark.sql.session.timeZone": "UTC",
    "spark.ui.showConsoleProgress": "false",
    "spark.ui.enabled": "false",
    "spark.sql.shuffle.partitions": "8",
    "spark.driver.memory": "1g",
}

CONNECT_CONF: dict[str, str] = {
    key: DEFAULT_CONF[key]
    for key in ("spark.sql.execution.arrow.pyspark.enabled", "spark.sql.session.timeZone")
}


def use_this_python_for_workers() -> None:
    """Point PySpark workers at this interpreter unless the user chose another."""
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)


def spark_session(
    settings: Settings, app_name: str = "microbatch", conf: Mapping[str, str] | None = None
) -> SparkSession:
    """Get or create the session for ``settings.spark_master`` with our defaults."""
    use_this_python_for_workers()
    from pyspark.sql import SparkSession

    if settings.spark_master.startswith("sc://"):
        # Spark Connect: the server owns the application; only runtime SQL confs apply.
        builder = SparkSession.builder.remote(settings.spark_master)
        for key, value in {**CONNECT_CONF, **(conf or {})}.items():
            builder = builder.config(key, value)
        return builder.getOrCreate()
    builder = SparkSession.builder.master(settings.spark_master).appName(app_name)
    local = {}
    if settings.spark_master.startswith("local"):
        # Keep the driver on loopback: this machine's other addresses may not route.
        local = {"spark.driver.host": "127.0.0.1", "spark.driver.bindAddress": "127.0.0.1"}
    for key, value in {**DEFAULT_CONF, **local, **(conf or {})}.items():
        builder = builder.config(key, value)
    session = builder.getOrCreate()
    session.sparkContext.setLogLevel("WARN")
    return session
