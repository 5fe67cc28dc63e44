"""What Airflow's ProvidersManager learns from the ``apache_airflow_provider`` entry point
of the ``microbatch-airflow`` distribution (``plugins/pyproject.toml``).

It lists the connection types (with the fields of their forms), the ``[microbatch]``
configuration section, the trigger, the operators and the plugin. The plugin itself is
registered through the ``airflow.plugins`` entry point, as Airflow's own providers do; the
plugins folder skips this package (``plugins/.airflowignore``) so it is registered once.
"""

from __future__ import annotations

from typing import Any

PACKAGE = "microbatch-airflow"
INTEGRATION = "Microbatch"
VERSION = "0.1.0"


def _text(label: str, description: str) -> dict[str, Any]:
    return {
        "label": label,
        "description": description,
        "schema": {"type": ["string", "null"]},
    }


def get_provider_info() -> dict[str, Any]:
    return {
        "package-name": PACKAGE,
        "name": "Microbatch",
        "description": (
            "Exactly-once, rescalable micro-batch pipelines on Spark: one DAG per pipeline, "
            "one batch per run (docs/airflow.md)."
        ),
        "versions": [VERSION],
        "integrations": [{"integration-name": INTEGRATION, "tags": ["software"]}],
        "operators": [
            {"integration-name": INTEGRATION, "python-modules": ["microbatch_airflow.operators"]}
        ],
        "hooks": [
            {"integration-name": INTEGRATION, "python-modules": ["microbatch_airflow.hooks"]}
        ],
        "triggers": [
            {"integration-name": INTEGRATION, "python-modules": ["microbatch_airflow.triggers"]}
        ],
        "connection-types": [
            {
                "hook-class-name": "microbatch_airflow.hooks.MicrobatchKafkaHook",
                "hook-name": "Microbatch Kafka",
                "connection-type": "microbatch_kafka",
                "conn-fields": {
                    "bootstrap_servers": _text(
                        "Bootstrap servers", "h1:9092,h2:9092 (else host:port above)"
                    ),
                    "security_protocol": _text("Security protocol", "PLAINTEXT, SASL_SSL, ..."),
                    "sasl_mechanism": _text("SASL mechanism", "PLAIN, SCRAM-SHA-512, ..."),
                    "ssl_cafile": _text("CA file", "path of the brokers' CA certificate"),
                },
                "ui-field-behaviour": {
                    "hidden-fields": ["schema", "extra"],
                    "relabeling": {"login": "SASL user", "password": "SASL password"},
                    "placeholders": {"host": "127.0.0.1", "port": "9092"},
                },
            },
            {
                "hook-class-name": "microbatch_airflow.hooks.MicrobatchS3Hook",
                "hook-name": "Microbatch S3",
                "connection-type": "microbatch_s3",
                "conn-fields": {
                    "endpoint_url": _text("Endpoint URL", "empty for AWS S3"),
                    "region_name": _text("Region", "us-east-1"),
                    "bucket": _text("Bucket", "the pipelines' default bucket"),
                },
                "ui-field-behaviour": {
                    "hidden-fields": ["host", "port", "schema", "extra"],
                    "relabeling": {"login": "Access key id", "password": "Secret access key"},
                    "placeholders": {},
                },
            },
            {
                "hook-class-name": "microbatch_airflow.hooks.MicrobatchSparkHook",
                "hook-name": "Microbatch Spark",
                "connection-type": "microbatch_spark",
                "ui-field-behaviour": {
                    "hidden-fields": ["schema", "login", "password", "extra"],
                    "relabeling": {"host": "Master URL"},
                    "placeholders": {"host": "spark://spark-master or sc://host or local[*]"},
                },
            },
        ],
        "config": {
            "microbatch": {
                "description": "The Microbatch page in the Airflow UI.",
                "options": {
                    "pipelines": {
                        "description": (
                            "Extra pipelines for the Microbatch page, as comma-separated "
                            "name=checkpoint_url pairs (an entry overrides the location the "
                            "pipeline's last asset event recorded). Pipelines of microbatch "
                            "DAGs are listed without it."
                        ),
                        "version_added": "0.1.0",
                        "type": "string",
                        "example": "clickstream=s3://microbatch/clickstream/checkpoints",
                        "default": "",
                    }
                },
            }
        },
        "plugins": [
            {"name": "microbatch", "plugin-class": "microbatch_airflow.plugin.MicrobatchPlugin"}
        ],
    }
