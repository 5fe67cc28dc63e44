"""Read an Iceberg table with Apache Iceberg's own Java reader, in a JVM of its own.

Spark 4.2 has no Iceberg connector yet (``iceberg-spark-runtime`` 1.12.0 is built for Spark
4.1, and its catalog and source classes fail to link against 4.2), so ``spark.table`` cannot
read it. The runtime jar's Iceberg core is plain Java, though: in a short-lived ``local[1]``
Spark JVM (~7 s), Iceberg's ``JdbcCatalog`` opens the same SQLite catalog as pyiceberg's SQL
catalog, and ``IcebergGenerics`` reads the current snapshot (planning from the manifests,
columns by field id). It prints rows and snapshot summaries as one JSON line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from microbatch.localstack.iceberg_jars import ensure_iceberg_jars

SCRIPT = r"""
import json, sys
from pyspark.sql import SparkSession
uri, warehouse, catalog_name, identifier, classpath = sys.argv[1:6]
spark = (SparkSession.builder.master("local[1]").appName("iceberg-read")
         .config("spark.driver.extraClassPath", classpath)
         .config("spark.ui.enabled", "false")
         # a short-lived JVM: the client compiler and a serial GC start faster
         .config("spark.driver.extraJavaOptions", "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC")
         .getOrCreate())
spark.sparkContext.setLogLevel("ERROR")
jvm = spark._jvm
props = jvm.java.util.HashMap()
props.put("uri", uri)
props.put("warehouse", warehouse)
catalog = jvm.org.apache.iceberg.jdbc.JdbcCatalog()
catalog.setConf(spark._jsc.hadoopConfiguration())
catalog.initialize(catalog_name, props)
table = catalog.loadTable(jvm.org.apache.iceberg.catalog.TableIdentifier.parse(identifier))
columns = [f.name() for f in table.schema().columns()]
rows, records = [], jvm.org.apache.iceberg.data.IcebergGenerics.read(table).build().iterator()
while records.hasNext():
    record = records.next()
    rows.append({c: None if record.getField(c) is None else str(record.getField(c))
                 for c in columns})
snapshots = [{"operation": s.operation(), "summary": dict(s.summary())}
             for s in table.snapshots()]
print("RESULT " + json.dumps({"columns": columns, "rows": rows, "snapshots": snapshots}))
spark.stop()
"""


def java_read_iceberg(
    catalog_db: Path, warehouse: str, catalog_name: str, identifier: str, home: Path
) -> dict[str, Any]:
    """{"columns", "rows" (values as Java's toString), "snapshots" [{"operation",
    "summary"}]} as Iceberg's Java reader sees the table through the SQLite catalog."""
    classpath = ":".join(str(j) for j in ensure_iceberg_jars(home))
    env = {**os.environ, "PYSPARK_PYTHON": sys.executable}
    args = [f"jdbc:sqlite:{catalog_db}", warehouse, catalog_name, identifier, classpath]
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT, *args],
        capture_output=True, text=True, timeout=300, env=env, check=False,
    )  # fmt: skip
    for line in result.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    raise RuntimeError(f"Iceberg's Java read of {identifier} failed:\n{result.stderr[-3000:]}")
