"""Read a Delta table with Spark's own Delta reader (delta-spark), in a JVM of its own.

The shared test SparkSession is started once without Delta's SQL extension and catalog,
and a running JVM cannot load a data source's jars afterwards; so each read here is a
short-lived ``local[1]`` session in a subprocess (~10 s), printing the rows as JSON lines.
The table is copied to a local folder first: pyspark ships no S3 filesystem (hadoop-aws
and the AWS SDK bundle are ~600 MB), and the copy holds the same log and files.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from microbatch.localstack.delta_jars import delta_jars, spark_conf
from microbatch.storage import open_store

SCRIPT = r"""
import json, sys
from pyspark.sql import SparkSession
conf = json.loads(sys.argv[2])
conf.update({"spark.ui.enabled": "false", "spark.sql.shuffle.partitions": "1",
             # a short-lived JVM: the client compiler and a serial GC start faster
             "spark.driver.extraJavaOptions": "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"})
builder = SparkSession.builder.master("local[1]").appName("delta-read")
for k, v in conf.items():
    builder = builder.config(k, v)
spark = builder.getOrCreate()
spark.sparkContext.setLogLevel("ERROR")
path = sys.argv[1]
history = spark.sql(f"DESCRIBE HISTORY delta.`{path}`").select("version", "operation")
out = {"rows": [r.asDict() for r in spark.read.format("delta").load(path).collect()],
       "history": [r.asDict() for r in history.orderBy("version").collect()]}
print("RESULT " + json.dumps(out, default=str))
spark.stop()
"""


def copy_table(uri: str, settings: Any, into: Path) -> Path:
    """Every object under ``uri`` (log and data files) copied to the folder ``into``."""
    store = open_store(uri, settings)
    for key in store.list(""):
        path = into / key
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(store.get(key))
    return into


def spark_read_delta(path: Path, home: Path) -> dict[str, Any]:
    """{"rows": [...], "history": [{"version", "operation"}]} as Spark's Delta reads them."""
    jars = delta_jars(home)
    if not jars:
        raise RuntimeError("the delta-spark jars are missing: run `make jars`")
    env = {**os.environ, "PYSPARK_PYTHON": sys.executable}
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(path), json.dumps(spark_conf(jars))],
        capture_output=True, text=True, timeout=300, env=env, check=False,
    )  # fmt: skip
    for line in result.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    raise RuntimeError(f"Spark's Delta read of {path} failed:\n{result.stderr[-3000:]}")
