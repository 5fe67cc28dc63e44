"""Airflow connections translate into settings; secrets stay out of what is shown."""

from __future__ import annotations

import pytest
from airflow.sdk import Connection

from microbatch import Settings
from microbatch_airflow.connections import (
    kafka_overrides,
    postgres_overrides,
    s3_overrides,
    spark_overrides,
)


def test_kafka_connection_prefers_bootstrap_servers_extra_over_host():
    conn = Connection(
        conn_id="k", conn_type="kafka", host="ignored", extra='{"bootstrap_servers": "a:1,b:2"}'
    )

    assert kafka_overrides(conn) == {"kafka_bootstrap_servers": "a:1,b:2"}


def test_kafka_connection_with_only_a_host_uses_host_and_port():
    conn = Connection(conn_id="k", conn_type="kafka", host="broker.internal", port=19092)

    assert kafka_overrides(conn) == {"kafka_bootstrap_servers": "broker.internal:19092"}


def test_kafka_connection_of_a_secured_cluster_sets_security_protocol_and_sasl_user():
    conn = Connection(
        conn_id="k",
        conn_type="kafka",
        login="etl",
        password="pw-123",
        extra='{"bootstrap_servers": "a:9096", "security_protocol": "SASL_SSL", '
        '"sasl_mechanism": "SCRAM-SHA-256", "ssl_cafile": "/etc/ca.pem"}',
    )

    settings = Settings.from_env(env={}, **kafka_overrides(conn))

    assert settings.kafka_client_config() == {
        "security_protocol": "SASL_SSL",
        "sasl_mechanism": "SCRAM-SHA-256",
        "sasl_plain_username": "etl",
        "sasl_plain_password": "pw-123",
        "ssl_cafile": "/etc/ca.pem",
    }


def test_s3_connection_maps_keys_endpoint_region_and_bucket():
    conn = Connection(
        conn_id="s",
        conn_type="aws",
        login="AKIA123",
        password="s3cr3t",
        extra='{"endpoint_url": "http://minio:9000", "region_name": "eu-west-1", "bucket": "lake"}',
    )

    settings = Settings.from_env(env={}, **s3_overrides(conn))

    assert settings.s3_access_key_id == "AKIA123"
    assert settings.s3_secret_access_key == "s3cr3t"
    assert settings.s3_endpoint_url == "http://minio:9000"
    assert (settings.s3_region, settings.s3_bucket) == ("eu-west-1", "lake")
    assert "s3cr3t" not in repr(settings)


def test_s3_connection_with_empty_endpoint_means_aws():
    conn = Connection(conn_id="s", conn_type="aws", extra='{"endpoint_url": ""}')

    assert s3_overrides(conn) == {"s3_endpoint_url": ""}


@pytest.mark.parametrize(
    ("host", "port", "master"),
    [
        ("spark-master", 7077, "spark://spark-master:7077"),
        ("spark://spark-master", 7077, "spark://spark-master:7077"),
        ("sc://connect", 15002, "sc://connect:15002"),
        ("local[4]", None, "local[4]"),
        ("yarn", None, "yarn"),
    ],
)
def test_spark_connection_becomes_a_master_url(host, port, master):
    conn = Connection(conn_id="sp", conn_type="spark", host=host, port=port)

    assert spark_overrides(conn) == {"spark_master": master}


def test_postgres_connection_becomes_the_sinks_dsn_and_its_password_is_masked():
    conn = Connection(
        conn_id="p",
        conn_type="postgres",
        host="db.internal",
        port=5432,
        login="writer",
        password="pa ss'word",
        schema="analytics",
        extra='{"sslmode": "require"}',
    )

    settings = Settings.from_env(env={}, **postgres_overrides(conn))

    from psycopg.conninfo import conninfo_to_dict

    assert conninfo_to_dict(settings.postgres_dsn) == {
        "host": "db.internal",
        "port": "5432",
        "user": "writer",
        "password": "pa ss'word",
        "dbname": "analytics",
        "sslmode": "require",
    }
    assert "pa ss'word" in settings.secret_values()
    assert "pa ss" not in repr(settings)
