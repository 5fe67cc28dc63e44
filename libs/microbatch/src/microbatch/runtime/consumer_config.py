"""The consumer settings a pipeline may tune: ``KafkaSource(consumer_config={...})``.

A source's ``consumer_config`` is in kafka-python's names and goes to whichever reader
stage 1 uses: kafka-python takes it as is, Spark's Kafka source as the Java consumer's
setting of the same meaning (:func:`microbatch.kafka.spark_source.consumer_options`). So
only settings both readers understand, with one meaning, are accepted
(:data:`TUNABLE`). Settings that decide which records a range holds are fixed by the
readers; how to connect (security) is the deployment's, set once for every client in
:class:`~microbatch.settings.Settings`, not per pipeline.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from microbatch.errors import ConfigError
from microbatch.settings import KAFKA_TUNABLE as TUNABLE

#: Settings the readers fix: they decide which records a planned range returns.
FIXED = frozenset(
    {"enable_auto_commit", "isolation_level", "auto_offset_reset", "group_id", "check_crcs"}
)
_TEXT = ("client_id", "client_rack")
_SECURITY_PREFIXES = ("security_", "ssl_", "sasl_")
_WHERE_SECURITY = (
    "MICROBATCH_KAFKA_SECURITY_PROTOCOL, MICROBATCH_KAFKA_SASL_MECHANISM, "
    "MICROBATCH_KAFKA_SASL_USERNAME/_PASSWORD and MICROBATCH_KAFKA_SSL_CAFILE (Settings, "
    "or the Airflow connection), which every Kafka client of the deployment uses"
)


def check_consumer_config(where: str, config: Mapping[str, Any] | None) -> dict[str, Any]:
    """``config`` as a plain dict, or :class:`ConfigError` naming the first setting that
    is not a tunable one (security, a fixed setting, a typo) and where it belongs."""
    if config is None:
        return {}
    if not isinstance(config, Mapping):
        raise ConfigError(
            f"{where}: consumer_config must be a dict of kafka-python consumer settings, "
            f"e.g. {{'fetch_max_wait_ms': 10}}, got {config!r}"
        )
    for name, value in config.items():
        if not isinstance(name, str):
            raise ConfigError(f"{where}: consumer_config keys are setting names: {name!r}")
        if name.startswith(_SECURITY_PREFIXES):
            raise ConfigError(
                f"{where}: consumer_config may not hold {name!r}: how to connect is set once "
                f"for the deployment, in {_WHERE_SECURITY}"
            )
        if name in FIXED:
            raise ConfigError(
                f"{where}: consumer_config may not set {name!r}: the readers fix it, as it "
                "decides which records a planned offset range returns"
            )
        if name not in TUNABLE:
            raise ConfigError(
                f"{where}: consumer_config {name!r} is not a consumer setting both readers "
                f"take (kafka-python names: {', '.join(sorted(TUNABLE))})"
            )
        textual = name in _TEXT
        if not (isinstance(value, str) if textual else type(value) is int and value >= 0):
            kind = "a string" if textual else "a whole number >= 0 (ms or bytes)"
            raise ConfigError(f"{where}: consumer_config {name!r} must be {kind}, got {value!r}")
    return dict(config)
