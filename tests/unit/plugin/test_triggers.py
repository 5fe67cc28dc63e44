"""The new-data trigger serializes to a class path plus plain, secret-free kwargs."""

from __future__ import annotations

import importlib
import json

from microbatch_airflow.freshness import PipelineFacts
from microbatch_airflow.triggers import NewDataTrigger

FACTS = PipelineFacts(
    name="clickstream",
    checkpoints="s3://lake/clickstream/checkpoints",
    topics=("clicks",),
    allowed_lateness_s=60.0,
    idle_timeout_s=30.0,
)


def test_trigger_serializes_to_an_importable_classpath_and_json_kwargs():
    trigger = NewDataTrigger(FACTS.to_json(), s3_conn_id="lake", wait_s=120, poll_interval_s=15)

    classpath, kwargs = trigger.serialize()

    module, _, name = classpath.rpartition(".")
    assert getattr(importlib.import_module(module), name) is NewDataTrigger
    assert json.loads(json.dumps(kwargs)) == kwargs
    assert kwargs == {
        "facts": FACTS.to_json(),
        "kafka_conn_id": "microbatch_kafka",
        "s3_conn_id": "lake",
        "wait_s": 120.0,
        "poll_interval_s": 15.0,
    }


def test_trigger_rebuilt_from_its_kwargs_serializes_identically():
    first = NewDataTrigger(FACTS.to_json(), wait_s=5)

    again = NewDataTrigger(**first.serialize()[1])

    assert again.serialize() == first.serialize()
    assert PipelineFacts.from_json(again.facts) == FACTS


def test_facts_of_a_pipeline_without_event_time_have_no_lateness():
    facts = PipelineFacts.from_json({**FACTS.to_json(), "allowed_lateness_s": None,
                                     "idle_timeout_s": None})  # fmt: skip

    assert facts.allowed_lateness_s is None
    assert facts.topics == ("clicks",)
