"""Building the SparkSession the same way for jobs, tests and the demo.

``MICROBATCH_SPARK_MASTER`` decides the engine: ``local[*]``, a cluster
(``spark://``, ``k8s://``, ``yarn``) or a warm Spark Connect server (``sc://host:port``).

Warm mode keeps more than the JVM warm: every batch of one pipeline joins the same Connect
*session* (a stable session id per server, application name and UTC day), and a session
owns its Python worker processes on the server. A batch therefore finds workers that
already imported the library and its clients, instead of starting a Python daemon and
importing everything again (several seconds). An expired or closed session is skipped for
the next id of the day; the URL's own ``;session_id=`` wins when given.

Workers must run the driver's interpreter (the venv's Python): otherwise they pick up
``python3`` from PATH and fail with "No module named pyarrow". pyspark is imported
lazily so the rest of the library works without it.
"""

from __future__ import annotations

import datetime as dt
import logging
import os
import sys
import uuid
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from microbatch.settings import Settings

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

log = logging.getLogger(__name__)

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

#: Session ids tried per day before falling back to a fresh session (cold Python workers).
CONNECT_SESSION_IDS_PER_DAY = 4
SESSION_CLOSED = "INVALID_HANDLE.SESSION_CLOSED"


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
        return connect_session(settings.spark_master, app_name, {**CONNECT_CONF, **(conf or {})})
    builder = SparkSession.builder.master(settings.spark_master).appName(app_name)
    local = {}
    if settings.spark_master.startswith("local"):
        # Keep the driver on loopback: this machine's other addresses may not route.
        local = {"spark.driver.host": "127.0.0.1", "spark.driver.bindAddress": "127.0.0.1"}
    merged = with_kafka_connector(settings, {**DEFAULT_CONF, **local, **(conf or {})})
    for key, value in merged.items():
        builder = builder.config(key, value)
    session = builder.getOrCreate()
    session.sparkContext.setLogLevel(settings.spark_log_level)
    return session


def with_kafka_connector(settings: Settings, conf: Mapping[str, str]) -> dict[str, str]:
    """``conf`` plus Spark's Kafka connector jars on ``spark.jars`` when ``make jars``
    resolved them, for the masters whose driver this process starts (``local``, standalone
    ``spark://``): stage 1 then reads Kafka with the JVM source (``KafkaSource(reader=
    "auto")``). Kubernetes and YARN deployments ship jars their own way."""
    out = dict(conf)
    if not settings.spark_master.startswith(("local", "spark://")):
        return out
    from microbatch.spark_jars import spark_kafka_jars

    given = [jar for jar in out.get("spark.jars", "").split(",") if jar]
    extra = [str(jar) for jar in spark_kafka_jars(settings.home_path) if str(jar) not in given]
    if extra:
        out["spark.jars"] = ",".join(given + extra)
    return out


def connect_session_id(master: str, app_name: str, day: dt.date, attempt: int = 0) -> str:
    """The Connect session id batches of ``app_name`` share on ``master`` on ``day``.

    Deterministic, so separate client processes (one per batch) join one server session
    and its warm Python workers; a new id each UTC day, and ``attempt`` skips ids whose
    session the server closed (idle timeout, ``stop()``). A version-4-shaped UUID, as
    the Connect client requires."""
    seed = uuid.uuid5(uuid.NAMESPACE_URL, f"{master}|{app_name}|{day.isoformat()}|{attempt}")
    return str(uuid.UUID(bytes=seed.bytes, version=4))


def with_session_id(master: str, session_id: str) -> str:
    """``master`` (``sc://host:port[/;param=value...]``) with ``;session_id=`` added."""
    base = master if "/;" in master else master.rstrip("/") + "/"
    return f"{base};session_id={session_id}"


def connect_session(master: str, app_name: str, conf: Mapping[str, str]) -> SparkSession:
    """The active Connect session, else this pipeline's shared session of the day (see the
    module docstring), else a fresh one."""
    from pyspark.errors import PySparkException
    from pyspark.sql import SparkSession
    from pyspark.sql.connect.session import SparkSession as ConnectSession

    active = ConnectSession.getActiveSession()
    if active is not None:
        return active
    if "session_id=" in master:
        candidates = [master]
    else:
        today = dt.datetime.now(dt.UTC).date()
        candidates = [
            with_session_id(master, connect_session_id(master, app_name, today, attempt))
            for attempt in range(CONNECT_SESSION_IDS_PER_DAY)
        ] + [master]
    for url in candidates:
        builder = SparkSession.builder.remote(url)  # also switches pyspark to Connect mode
        for key, value in conf.items():
            builder = builder.config(key, value)
        try:
            return builder.create()  # applying the confs is a first round trip: it fails fast
        except PySparkException as e:
            if e.getCondition() != SESSION_CLOSED or url == candidates[-1]:
                raise
            log.info("Spark Connect closed the session of %s; trying the next id", app_name)
            _discard(ConnectSession)
    raise AssertionError("unreachable")  # pragma: no cover


def _discard(connect_session_class: Any) -> None:
    """Close the session ``create()`` just registered and failed with, now (a channel
    left to the garbage collector at exit can hang the process), and unregister it so the
    next ``create()`` becomes the active session."""
    failed = connect_session_class._active_session.session
    if failed is not None:
        failed.release_session_on_close = False  # nothing to release: the server closed it
        failed.stop()
