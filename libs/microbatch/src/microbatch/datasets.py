"""What a pipeline reads and writes, named as lineage tools name datasets.

A dataset is a ``(namespace, name)`` pair in the OpenLineage naming convention, so a
lineage backend (Marquez, DataHub, ...) joins a pipeline's datasets with those of other
jobs that read or write the same data:

=====================  ===============================  ==============================
where                  namespace                        name
=====================  ===============================  ==============================
Kafka topic            ``kafka://<first broker>``       the topic
S3 object prefix       ``s3://<bucket>``                the key prefix, no leading ``/``
local path             ``file``                         the absolute path
=====================  ===============================  ==============================

:func:`pipeline_lineage` is what a batch's job prints with its result (``lineage``): the
checkpoint location, the source topics and each sink's dataset. Plain JSON, no secrets
(URLs and topics only), and no lineage library needed here: the Airflow plugin turns it
into OpenLineage objects.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any
from urllib.parse import unquote, urlparse

from microbatch.settings import Settings


@dataclasses.dataclass(frozen=True)
class DatasetRef:
    """One dataset: ``namespace`` and ``name`` as the table above."""

    namespace: str
    name: str

    def to_json(self) -> dict[str, str]:
        return {"namespace": self.namespace, "name": self.name}


def kafka_dataset(bootstrap_servers: str, topic: str) -> DatasetRef:
    """A topic, in the namespace of the cluster's first bootstrap server (``host:port``)."""
    first = bootstrap_servers.split(",")[0].strip()
    if "://" in first:  # SASL_SSL://h:9093 style listeners
        first = first.split("://", 1)[1]
    return DatasetRef(f"kafka://{first}", topic)


def url_dataset(url: str) -> DatasetRef:
    """An ``s3://bucket/prefix`` URL, a ``file://`` URL or a local path."""
    parsed = urlparse(url)
    if parsed.scheme == "s3":
        return DatasetRef(f"s3://{parsed.netloc}", parsed.path.strip("/"))
    path = unquote(parsed.path) if parsed.scheme == "file" else url
    return DatasetRef("file", os.path.abspath(path).rstrip("/") or "/")


def pipeline_lineage(pipeline: Any, settings: Settings) -> dict[str, Any]:
    """``{"checkpoints", "inputs": [{namespace, name}], "outputs": [{sink, namespace,
    name}]}`` of ``pipeline`` (a :class:`microbatch.Pipeline`) with ``settings``' brokers."""
    inputs = [
        kafka_dataset(settings.kafka_bootstrap_servers, topic).to_json()
        for topic in pipeline.source.topics
    ]
    outputs = []
    for sink in pipeline.all_sinks():
        ref = sink.dataset(settings)
        if ref is not None:
            outputs.append({"sink": sink.name, **ref.to_json()})
    return {"checkpoints": pipeline.checkpoints, "inputs": inputs, "outputs": outputs}
