"""Airflow connections → :class:`microbatch.Settings` (the library never reads Airflow).

Precedence for each service: the Airflow connection when it is defined, else the
``MICROBATCH_*`` environment variables, else the defaults of the settings module.

======================  ============================================================
connection id           fields used
======================  ============================================================
``microbatch_kafka``    extra ``bootstrap_servers`` (``"h1:9092,h2:9092"``), else
                        ``host:port``; secured clusters: extra ``security_protocol``
                        (``SASL_SSL``, ...), ``sasl_mechanism``, ``ssl_cafile``; login
                        and password = the SASL user
``microbatch_s3``       login = access key id, password = secret key, extra
                        ``endpoint_url`` (omit for AWS), ``region_name``, ``bucket``
``microbatch_spark``    host (+ port) = master URL: ``local[*]``, ``spark://h``,
                        ``sc://h``, ``k8s://https://h``, ``yarn``
``microbatch_postgres`` the PostgreSQL sinks' database (any connection type, e.g.
                        ``postgres``): host, port, login, password, schema = the
                        database; extra = libpq options (``{"sslmode": "require"}``)
======================  ============================================================

Every secret of the resolved settings (the S3 secret key, the Kafka SASL password, the
PostgreSQL DSN and its password), from a
connection or a ``MICROBATCH_*`` variable, is registered with Airflow's secret masker on
the way out: task logs, rendered template fields and the triggerer's log show ``***``.
"""

from __future__ import annotations

from typing import Any

from microbatch.settings import Settings

KAFKA_CONN_ID = "microbatch_kafka"
S3_CONN_ID = "microbatch_s3"
SPARK_CONN_ID = "microbatch_spark"
POSTGRES_CONN_ID = "microbatch_postgres"


def kafka_overrides(conn: Any) -> dict[str, str]:
    extra = conn.extra_dejson
    servers = extra.get("bootstrap_servers") or extra.get("bootstrap.servers")
    if not servers and conn.host:
        servers = f"{conn.host}:{conn.port or 9092}"
    overrides = {
        "kafka_bootstrap_servers": servers,
        "kafka_security_protocol": extra.get("security_protocol"),
        "kafka_sasl_mechanism": extra.get("sasl_mechanism"),
        "kafka_sasl_username": conn.login,
        "kafka_sasl_password": conn.password,
        "kafka_ssl_cafile": extra.get("ssl_cafile"),
    }
    return {k: v for k, v in overrides.items() if v}


def s3_overrides(conn: Any) -> dict[str, str]:
    extra = conn.extra_dejson
    overrides = {
        "s3_access_key_id": conn.login,
        "s3_secret_access_key": conn.password,
        "s3_endpoint_url": extra.get("endpoint_url"),
        "s3_region": extra.get("region_name"),
        "s3_bucket": extra.get("bucket"),
    }
    if "endpoint_url" in extra and not extra["endpoint_url"]:
        overrides["s3_endpoint_url"] = ""  # explicitly AWS's own endpoint
    return {k: v for k, v in overrides.items() if v is not None}


def spark_overrides(conn: Any) -> dict[str, str]:
    if not conn.host:
        return {}
    master = (
        conn.host
        if "://" in conn.host or conn.host.startswith(("local", "yarn"))
        else (f"spark://{conn.host}")
    )
    if conn.port and "://" in master:
        master = f"{master}:{conn.port}"
    return {"spark_master": master}


def postgres_overrides(conn: Any) -> dict[str, str]:
    """The connection as a libpq DSN (keyword form: values quoted as libpq wants)."""
    from psycopg.conninfo import make_conninfo

    if not conn.host:
        return {}
    params = {
        "host": conn.host,
        "port": conn.port,
        "user": conn.login,
        "password": conn.password,
        "dbname": conn.schema,
        **{k: v for k, v in conn.extra_dejson.items() if isinstance(v, str | int)},
    }
    return {"postgres_dsn": make_conninfo(**{k: v for k, v in params.items() if v})}


def _optional_connection(conn_id: str | None) -> Any | None:
    if not conn_id:
        return None
    from airflow.sdk import Connection
    from airflow.sdk.exceptions import AirflowNotFoundException

    try:
        return Connection.get(conn_id)
    except AirflowNotFoundException:
        return None


async def _aoptional_connection(conn_id: str | None) -> Any | None:
    if not conn_id:
        return None
    from airflow.sdk import Connection
    from airflow.sdk.exceptions import AirflowNotFoundException

    try:
        return await Connection.async_get(conn_id)
    except AirflowNotFoundException:
        return None


def _overrides(conns: dict[str, Any]) -> dict[str, str]:
    overrides: dict[str, str] = {}
    for kind, translate in (
        ("kafka", kafka_overrides),
        ("s3", s3_overrides),
        ("spark", spark_overrides),
        ("postgres", postgres_overrides),
    ):
        if conns.get(kind) is not None:
            overrides.update(translate(conns[kind]))
    return overrides


async def asettings_from_airflow(
    kafka_conn_id: str | None = KAFKA_CONN_ID,
    s3_conn_id: str | None = S3_CONN_ID,
    spark_conn_id: str | None = SPARK_CONN_ID,
    postgres_conn_id: str | None = None,
) -> Settings:
    """:func:`settings_from_airflow` for async code (triggers run in the triggerer; they
    read Kafka and S3 only, so no PostgreSQL connection unless asked)."""
    from airflow.sdk.log import amask_secret

    conns = {
        "kafka": await _aoptional_connection(kafka_conn_id),
        "s3": await _aoptional_connection(s3_conn_id),
        "spark": await _aoptional_connection(spark_conn_id),
        "postgres": await _aoptional_connection(postgres_conn_id),
    }
    settings = Settings.from_env(**_overrides(conns))
    for secret in settings.secret_values():
        await amask_secret(secret)
    return settings


def settings_from_airflow(
    kafka_conn_id: str | None = KAFKA_CONN_ID,
    s3_conn_id: str | None = S3_CONN_ID,
    spark_conn_id: str | None = SPARK_CONN_ID,
    postgres_conn_id: str | None = POSTGRES_CONN_ID,
) -> Settings:
    """Settings for a task: each defined connection overrides its part of the env."""
    conns = {
        "kafka": _optional_connection(kafka_conn_id),
        "s3": _optional_connection(s3_conn_id),
        "spark": _optional_connection(spark_conn_id),
        "postgres": _optional_connection(postgres_conn_id),
    }
    settings = Settings.from_env(**_overrides(conns))
    mask_settings(settings)
    return settings


def mask_settings(settings: Settings) -> None:
    """Register every secret of ``settings`` with Airflow's secret masker (task logs and
    rendered fields show ``***``), whatever its source: connection or ``MICROBATCH_*``."""
    from airflow.sdk.log import mask_secret

    for secret in settings.secret_values():
        mask_secret(secret)
