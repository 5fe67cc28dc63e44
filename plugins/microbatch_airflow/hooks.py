"""The provider's connection types: one hook per service, for the connection form.

Each hook names its connection type (``microbatch_kafka``, ``microbatch_s3``,
``microbatch_spark``) so Airflow's *Connections* form shows the fields the plugin reads,
labelled as it reads them (:mod:`microbatch_airflow.connections`). The operators read a
connection of any type by its id, so existing ``kafka``/``aws`` connections keep working.
A hook's :meth:`overrides` is the settings its connection contributes.
"""

from __future__ import annotations

from typing import Any, ClassVar

from airflow.sdk import BaseHook

from microbatch_airflow.connections import (
    KAFKA_CONN_ID,
    S3_CONN_ID,
    SPARK_CONN_ID,
    kafka_overrides,
    s3_overrides,
    spark_overrides,
)


class _MicrobatchHook(BaseHook):
    conn_name_attr = "conn_id"
    translate: ClassVar[Any]

    def __init__(self, conn_id: str | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.conn_id = conn_id or self.default_conn_name

    def overrides(self) -> dict[str, str]:
        """The ``Settings`` fields this connection sets."""
        return type(self).translate(self.get_connection(self.conn_id))


class MicrobatchKafkaHook(_MicrobatchHook):
    """Kafka brokers: extra ``bootstrap_servers`` (else host:port), SASL login/password."""

    default_conn_name = KAFKA_CONN_ID
    conn_type = "microbatch_kafka"
    hook_name = "Microbatch Kafka"
    translate = staticmethod(kafka_overrides)


class MicrobatchS3Hook(_MicrobatchHook):
    """S3 (or SeaweedFS, MinIO): access key / secret, extra ``endpoint_url``, ``region_name``,
    ``bucket``."""

    default_conn_name = S3_CONN_ID
    conn_type = "microbatch_s3"
    hook_name = "Microbatch S3"
    translate = staticmethod(s3_overrides)


class MicrobatchSparkHook(_MicrobatchHook):
    """The Spark master: host (+ port) = ``local[*]``, ``spark://h``, ``sc://h``, ``yarn``..."""

    default_conn_name = SPARK_CONN_ID
    conn_type = "microbatch_spark"
    hook_name = "Microbatch Spark"
    translate = staticmethod(spark_overrides)
