"""OpenLineage for a batch task: Kafka topics in, sinks out, and which batch it was.

Airflow's OpenLineage provider (``apache-airflow-providers-openlineage``) asks each
operator for its lineage when its task ends (``get_openlineage_facets_on_complete``); the
batch operator answers with :func:`batch_lineage` of the batch result its job printed,
which carries the pipeline's datasets (``lineage``, from
:func:`microbatch.datasets.pipeline_lineage` in the job's own process). So nothing here
loads the job file, and without the provider nothing here is imported.

- **inputs**: the source topics (namespace ``kafka://<broker>``, name = topic);
- **outputs**: one dataset per sink (``s3://<bucket>`` + key prefix, ``file`` + path, or a
  Kafka topic), with ``outputStatistics.rowCount`` = the rows the batch wrote there;
  none for a dry run (it writes nothing);
- **run facet** ``microbatch_batch`` (:class:`MicrobatchBatchRunFacet`): pipeline, batch
  and checkpoint id, status, records in, dead letters, rows out per sink, parallelism,
  watermark, replayed, and the checkpoint location.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attr
from openlineage.client.facet_v2 import RunFacet

#: The run facet's key in an OpenLineage event's ``run.facets``.
RUN_FACET = "microbatch_batch"
SCHEMA_URL = "https://microbatch.invalid/spec/facets/1-0-0/MicrobatchBatchRunFacet.json"


@attr.define
class MicrobatchBatchRunFacet(RunFacet):
    """The batch a task run committed (or planned, for a dry run)."""

    pipeline: str
    # OpenLineage facets name their fields in camelCase.
    batchId: int
    checkpointId: int  # the checkpoint a committed batch wrote: its batch id
    status: str
    recordsIn: int = 0
    deadLetters: int = 0
    outputs: dict[str, int] = attr.field(factory=dict)
    parallelism: int | None = None
    watermark: int | None = None
    replayed: bool = False
    checkpoints: str | None = None

    @staticmethod
    def _get_schema() -> str:
        return SCHEMA_URL


def batch_lineage(result: Mapping[str, Any] | None) -> Any:
    """The :class:`OperatorLineage` of one batch ``result`` (the batch task's XCom value);
    empty without one (the job failed before it printed a result)."""
    from airflow.providers.common.compat.openlineage.facet import (
        InputDataset,
        OutputDataset,
        OutputStatisticsOutputDatasetFacet,
    )
    from airflow.providers.openlineage.extractors import OperatorLineage

    if not result or result.get("batch_id") is None:
        return OperatorLineage()
    lineage = result.get("lineage") or {}
    inputs = [
        InputDataset(namespace=d["namespace"], name=d["name"]) for d in lineage.get("inputs", [])
    ]
    outputs = []
    committed = result.get("status") == "committed"
    counts = dict(result.get("outputs") or {})
    counts.setdefault("dead_letters", int(result.get("dead_letters") or 0))
    for d in lineage.get("outputs", []) if committed else []:
        rows = counts.get(d["sink"])
        facets = (
            {}
            if rows is None
            else {"outputStatistics": OutputStatisticsOutputDatasetFacet(rowCount=rows)}
        )
        outputs.append(OutputDataset(namespace=d["namespace"], name=d["name"], outputFacets=facets))
    facet = MicrobatchBatchRunFacet(
        pipeline=str(result.get("pipeline")),
        batchId=int(result["batch_id"]),
        checkpointId=int(result["batch_id"]),
        status=str(result.get("status")),
        recordsIn=int(result.get("records_in") or 0),
        deadLetters=int(result.get("dead_letters") or 0),
        outputs={str(k): int(v) for k, v in counts.items() if k != "dead_letters"},
        parallelism=result.get("parallelism"),
        watermark=result.get("watermark"),
        replayed=bool(result.get("replayed")),
        checkpoints=lineage.get("checkpoints"),
    )
    return OperatorLineage(inputs=inputs, outputs=outputs, run_facets={RUN_FACET: facet})
