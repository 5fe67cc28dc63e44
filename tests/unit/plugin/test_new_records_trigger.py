"""The event-driven watcher: fires once per backlog it has not fired for, retries a failed
check without firing, and serializes to plain kwargs; the DAG factory wires it in."""

from __future__ import annotations

import asyncio
import importlib
import json

import pytest

from microbatch_airflow import triggers
from microbatch_airflow.freshness import Decision, PipelineFacts
from microbatch_airflow.triggers import NewRecordsTrigger

FACTS = PipelineFacts(name="clicks", checkpoints="s3://lake/clicks/checkpoints",
                      topics=("clicks",))  # fmt: skip


def test_trigger_serializes_to_an_importable_classpath_and_json_kwargs():
    trigger = NewRecordsTrigger("/jobs/clicks.py", env={"MICROBATCH_X": "1"}, poll_interval_s=1)

    classpath, kwargs = trigger.serialize()

    module, _, name = classpath.rpartition(".")
    assert getattr(importlib.import_module(module), name) is NewRecordsTrigger
    assert json.loads(json.dumps(kwargs)) == kwargs
    assert NewRecordsTrigger(**kwargs).serialize() == (classpath, kwargs)
    assert kwargs["job"] == "/jobs/clicks.py" and kwargs["env"] == {"MICROBATCH_X": "1"}


def _events(checks: list, count: int) -> list[dict]:
    """The first ``count`` events of a trigger whose checks answer ``checks`` in turn (a
    Decision, or an exception to raise)."""
    answers = iter(checks)

    async def facts(self):
        self._settings = None
        return FACTS

    def check(facts, settings, now_ms, idle_timers):
        assert idle_timers is False  # time passing alone never fires an event
        answer = next(answers)
        if isinstance(answer, Exception):
            raise answer
        return answer

    async def first_events() -> list[dict]:
        trigger = NewRecordsTrigger("/jobs/clicks.py", poll_interval_s=0.0, max_backoff_s=0.0)
        out = []
        async for event in trigger.run():
            out.append(event.payload)
            if len(out) == count:
                return out
        return out

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(NewRecordsTrigger, "_facts", facts)
        mp.setattr(triggers, "check_for_work", check)
        return asyncio.run(first_events())


def test_one_backlog_fires_once_and_a_grown_backlog_or_a_new_checkpoint_fires_again():
    ten = Decision(True, "10 new offsets since checkpoint 4", 10, {"clicks[0]": 10})
    twelve = Decision(True, "12 new offsets since checkpoint 4", 12, {"clicks[0]": 12})
    idle = Decision(False, "no new records since checkpoint 5", 0, {"clicks[0]": 0})
    after = Decision(True, "3 new offsets since checkpoint 5", 3, {"clicks[0]": 3})

    events = _events([ten, ten, ten, twelve, twelve, idle, idle, after], count=3)

    assert [e["new_records"] for e in events] == [10, 12, 3]
    assert {e["status"] for e in events} == {"new_data"}
    assert {e["pipeline"] for e in events} == {"clicks"}


def test_a_failing_check_is_retried_and_never_fires():
    ten = Decision(True, "10 new offsets since checkpoint 4", 10, {"clicks[0]": 10})

    events = _events([OSError("broker down"), TimeoutError("s3"), ten], count=1)

    assert events == [ten.event() | {"pipeline": "clicks"}]


def test_schedule_on_new_data_watches_the_pipelines_records():
    from airflow.sdk.definitions.timetables.assets import AssetOrTimeSchedule

    from microbatch_airflow.dag_factory import microbatch_dag

    dag = microbatch_dag("unit_live", "jobs/clickstream.py", schedule="on_new_data",
                         new_data_poll_s=1.5, max_parallelism=8, default_parallelism=2)  # fmt: skip

    asset = dag.timetable.asset_condition
    assert not isinstance(dag.timetable, AssetOrTimeSchedule)
    assert asset.uri == "microbatch://clickstream/new-records"
    (watcher,) = asset.watchers
    assert isinstance(watcher.trigger, NewRecordsTrigger)
    assert watcher.trigger.job.endswith("jobs/clickstream.py")
    assert watcher.trigger.poll_interval_s == 1.5


def test_on_new_data_beside_a_cron_keeps_the_cron_and_its_data_intervals():
    from airflow.sdk.definitions.timetables.assets import AssetOrTimeSchedule

    from microbatch_airflow.dag_factory import microbatch_dag

    dag = microbatch_dag("unit_both", "jobs/clickstream.py", schedule="*/5 * * * *",
                         on_new_data=True, max_parallelism=8, default_parallelism=2)  # fmt: skip

    assert isinstance(dag.timetable, AssetOrTimeSchedule)
    assert type(dag.timetable.timetable).__name__ == "CronDataIntervalTimetable"
    assert dag.timetable.asset_condition.uri == "microbatch://clickstream/new-records"
