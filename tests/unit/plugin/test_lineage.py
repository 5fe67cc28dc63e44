"""The batch operator's OpenLineage facets, from a batch result as the job prints it (the
datasets come from the library's naming, ``microbatch.datasets``); serialized by the
OpenLineage client as its transports send them."""

from __future__ import annotations

import json

from openlineage.client.serde import Serde

from microbatch import Settings
from microbatch.datasets import kafka_dataset, pipeline_lineage, url_dataset
from microbatch.examples.clickstream import ClickstreamConfig, clickstream_pipeline
from microbatch_airflow.lineage import RUN_FACET, batch_lineage
from microbatch_airflow.operators import MicrobatchBatchOperator

SETTINGS = Settings.from_env(env={}, kafka_bootstrap_servers="k1:9092,k2:9092")


def result(status: str = "committed") -> dict:
    pipeline = clickstream_pipeline(ClickstreamConfig(root="s3://lake/cs", topic="clicks-x"))
    return {
        "pipeline": "clickstream",
        "batch_id": 7,
        "status": status,
        "parallelism": 2,
        "records_in": 120,
        "dead_letters": 3,
        "outputs": {"sessions": 40, "sessions_delta": 40, "sessions_topic": 40},
        "watermark": 1_767_225_600_000,
        "replayed": False,
        "lineage": pipeline_lineage(pipeline, SETTINGS),
    }


def test_datasets_follow_the_openlineage_naming(tmp_path):
    assert kafka_dataset("SASL_SSL://b1:9093,b2:9093", "t").to_json() == {
        "namespace": "kafka://b1:9093",
        "name": "t",
    }
    assert url_dataset("s3://bucket/a/b/").to_json() == {"namespace": "s3://bucket", "name": "a/b"}
    assert url_dataset(f"file://{tmp_path}/out").to_json() == {
        "namespace": "file",
        "name": f"{tmp_path}/out",
    }
    assert url_dataset("rel/dir").name.endswith("/rel/dir")


def test_a_committed_batch_has_its_topics_in_its_sinks_out_and_its_batch_as_a_run_facet():
    lineage = batch_lineage(result())

    assert [(d.namespace, d.name) for d in lineage.inputs] == [("kafka://k1:9092", "clicks-x")]
    outputs = {(d.namespace, d.name): d for d in lineage.outputs}
    assert set(outputs) == {
        ("s3://lake", "cs/sessions"),
        ("s3://lake", "cs/sessions_delta"),
        ("kafka://k1:9092", "sessions"),
        ("kafka://k1:9092", "clicks.dlq"),
    }
    assert outputs["s3://lake", "cs/sessions"].outputFacets["outputStatistics"].rowCount == 40
    assert outputs["kafka://k1:9092", "clicks.dlq"].outputFacets["outputStatistics"].rowCount == 3
    facet = json.loads(Serde.to_json(lineage.run_facets[RUN_FACET]))
    assert facet["batchId"] == facet["checkpointId"] == 7
    assert facet["recordsIn"] == 120 and facet["deadLetters"] == 3
    assert facet["outputs"] == {"sessions": 40, "sessions_delta": 40, "sessions_topic": 40}
    assert facet["checkpoints"] == "s3://lake/cs/checkpoints"
    assert facet["_schemaURL"].endswith("MicrobatchBatchRunFacet.json")


def test_a_dry_run_reads_its_topics_and_writes_nothing():
    lineage = batch_lineage(result("dry_run"))

    assert [d.name for d in lineage.inputs] == ["clicks-x"]
    assert lineage.outputs == []
    assert lineage.run_facets[RUN_FACET].status == "dry_run"


def test_no_result_gives_empty_lineage():
    lineage = batch_lineage(None)

    assert (lineage.inputs, lineage.outputs, lineage.run_facets) == ([], [], {})


def test_the_operator_answers_from_the_batch_it_ran_without_loading_the_job(tmp_path):
    job = tmp_path / "exploding_job.py"
    job.write_text("raise RuntimeError('job files are not loaded for lineage')\n")
    op = MicrobatchBatchOperator(task_id="batch", job=str(job))
    op._result = result()

    lineage = op.get_openlineage_facets_on_complete(None)

    assert lineage.run_facets[RUN_FACET].batchId == 7
    assert len(lineage.outputs) == 4
