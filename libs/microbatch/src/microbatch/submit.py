"""Build the ``spark-submit`` command for a job, the same way for the CLI, demo and Airflow.

The master comes from the settings (``MICROBATCH_SPARK_MASTER``); the settings themselves
travel to the driver as ``MICROBATCH_*`` environment variables, so the job reads exactly
what the caller resolved (including values taken from Airflow connections).
"""

from __future__ import annotations

import dataclasses
import os
import socket
import sys
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from microbatch.errors import ConfigError
from microbatch.executables import find_executable
from microbatch.settings import Settings
from microbatch.spark_jars import spark_kafka_jars


def spark_submit_binary() -> str:
    found = find_executable("spark-submit")
    if not found:
        raise ConfigError(
            "spark-submit not found next to this Python or on PATH: install pyspark "
            "(`make venv`) or a Spark distribution and put its bin/ on PATH"
        )
    return found


#: Where a batch goes when its Spark Connect server does not answer: a cold spark-submit.
FALLBACK_MASTER = "local[*]"
CONNECT_DEFAULT_PORT = 15002


def connect_server_answers(master: str, timeout: float = 3.0) -> bool:
    """Does the Spark Connect server of ``master`` (``sc://host[:port][/;params]``) accept
    a connection within ``timeout`` seconds?"""
    address = master.removeprefix("sc://").split("/", 1)[0]
    host, _, port = address.rpartition(":") if ":" in address else (address, "", "")
    try:
        with socket.create_connection(
            (host.strip("[]"), int(port or CONNECT_DEFAULT_PORT)), timeout=timeout
        ):
            return True
    except (OSError, ValueError):
        return False


def reachable_engine(settings: Settings, echo: Callable[[str], None]) -> Settings:
    """``settings``, with a Spark Connect master that does not answer replaced by
    :data:`FALLBACK_MASTER`: the batch runs cold rather than failing or hanging, and says
    so in its log."""
    master = settings.spark_master
    if not master.startswith("sc://") or connect_server_answers(master):
        return settings
    echo(
        f"Spark Connect server {master} does not answer: this batch runs cold with "
        f"spark-submit --master {FALLBACK_MASTER} instead (start the server: `make connect`, "
        "or `microbatch-stack up --only spark-connect`)"
    )
    return dataclasses.replace(settings, spark_master=FALLBACK_MASTER)


LOG4J2_CONFIG = """\
# microbatch: Spark's own log at {level} (MICROBATCH_SPARK_LOG_LEVEL), on stderr
rootLogger.level = {level}
rootLogger.appenderRef.stderr.ref = stderr
appender.stderr.type = Console
appender.stderr.name = stderr
appender.stderr.target = SYSTEM_ERR
appender.stderr.layout.type = PatternLayout
appender.stderr.layout.pattern = %d{{yy/MM/dd HH:mm:ss}} %p %c{{1}}: %m%n%ex
# Noisy at WARN on every start, harmless: native Hadoop libraries are optional.
logger.nativecode.name = org.apache.hadoop.util.NativeCodeLoader
logger.nativecode.level = error
"""


def log4j2_config(level: str) -> Path:
    """A log4j2 configuration that logs Spark's JVM at ``level`` (written once per level
    into the temp dir), for the driver's ``-Dlog4j2.configurationFile``: Spark's own
    default logs every start-up step at INFO before the job can set a level."""
    text = LOG4J2_CONFIG.format(level=level.lower())
    path = Path(tempfile.gettempdir()) / f"microbatch-spark-log4j2-{level.lower()}.properties"
    if not path.exists() or path.read_text() != text:
        partial = path.with_suffix(f".{os.getpid()}.tmp")
        partial.write_text(text)
        partial.replace(path)
    return path


def spark_submit_command(
    settings: Settings,
    job: str | Path,
    job_args: Sequence[str] = (),
    conf: Mapping[str, str] | None = None,
) -> tuple[list[str], dict[str, str]]:
    """``(argv, env)`` to run ``job`` against ``settings.spark_master``.

    Classic masters go through spark-submit; a Spark Connect URL (``sc://``) runs the job
    as a plain Python client of the warm server, with no JVM of its own. So does a dry
    run (``--dry-run`` among ``job_args``): it only plans, and never starts Spark.
    """
    job = Path(job)
    if not job.exists():
        raise ConfigError(f"Spark job {job} does not exist")
    if settings.spark_master.startswith("sc://") or "--dry-run" in job_args:
        # Warm mode: the Connect server already holds the JVM; the job is a plain client.
        argv = [sys.executable, str(job), *job_args]
    else:
        argv = [spark_submit_binary(), "--master", settings.spark_master]
        if settings.spark_master.startswith("local"):
            argv += ["--conf", "spark.driver.host=127.0.0.1"]
        argv += [
            "--driver-java-options",
            f"-Dlog4j2.configurationFile=file:{log4j2_config(settings.spark_log_level)}",
        ]
        jars = spark_kafka_jars(settings.home_path)
        if jars and settings.spark_master.startswith(("local", "spark://")):
            # Stage 1's JVM Kafka reader (``reader="spark"``; "auto" when it cannot use
            # confluent-kafka): spark-submit has started the driver's JVM by the time the
            # job builds its session, too late for spark.jars.
            argv += ["--jars", ",".join(str(jar) for jar in jars)]
        for key, value in (conf or {}).items():
            argv += ["--conf", f"{key}={value}"]
        argv += [str(job), *job_args]
    env = dict(os.environ)
    env.update(settings.to_env())
    env.setdefault("PYSPARK_PYTHON", sys.executable)
    env.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    if settings.spark_master.startswith("local"):
        # The driver binds to loopback anyway; this keeps Spark from warning that the
        # host name resolves to it, on every batch.
        env.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    return argv, env
