"""The triggers of the DAGs: "is there anything for the next batch?" (see ``freshness``).

:class:`NewRecordsTrigger` is the event-driven schedule's watcher (below).

:class:`NewDataTrigger` runs in the triggerer, so waiting for data holds no worker slot.
It serializes to its class path plus plain kwargs (no secrets: services are resolved from
the Airflow connections named by id, else ``MICROBATCH_*``) and fires exactly one event::

    {"status": "new_data" | "idle" | "error", "message": str, "new_records": int, "lag": {}}

With ``wait_s > 0`` it polls every ``poll_interval_s`` until data arrives or ``wait_s``
has passed; with ``wait_s = 0`` (the default) it checks once.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from airflow.triggers.base import BaseEventTrigger, BaseTrigger, TriggerEvent

from microbatch_airflow.connections import KAFKA_CONN_ID, S3_CONN_ID, asettings_from_airflow
from microbatch_airflow.freshness import PipelineFacts, check_for_work


class NewDataTrigger(BaseTrigger):
    """Fires when the pipeline has work (or once ``wait_s`` is over without any)."""

    def __init__(
        self,
        facts: dict[str, Any],
        *,
        kafka_conn_id: str | None = KAFKA_CONN_ID,
        s3_conn_id: str | None = S3_CONN_ID,
        wait_s: float = 0.0,
        poll_interval_s: float = 30.0,
    ) -> None:
        super().__init__()
        self.facts = PipelineFacts.from_json(facts).to_json()  # validates, stays plain
        self.kafka_conn_id = kafka_conn_id
        self.s3_conn_id = s3_conn_id
        self.wait_s = float(wait_s)
        self.poll_interval_s = float(poll_interval_s)

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (
            f"{type(self).__module__}.{type(self).__qualname__}",
            {
                "facts": self.facts,
                "kafka_conn_id": self.kafka_conn_id,
                "s3_conn_id": self.s3_conn_id,
                "wait_s": self.wait_s,
                "poll_interval_s": self.poll_interval_s,
            },
        )

    async def run(self) -> AsyncIterator[TriggerEvent]:
        facts = PipelineFacts.from_json(self.facts)
        try:
            settings = await asettings_from_airflow(self.kafka_conn_id, self.s3_conn_id, None)
        except Exception as exc:
            yield TriggerEvent(_error(facts, f"resolving connections: {exc}"))
            return
        deadline = time.monotonic() + self.wait_s
        while True:
            try:
                now_ms = int(time.time() * 1000)
                decision = await asyncio.to_thread(check_for_work, facts, settings, now_ms)
            except Exception as exc:
                yield TriggerEvent(_error(facts, str(exc)))
                return
            if decision.run or time.monotonic() + self.poll_interval_s > deadline:
                yield TriggerEvent(decision.event())
                return
            self.log.info("pipeline %s: %s; next check in %.0f s", facts.name,
                          decision.reason, self.poll_interval_s)  # fmt: skip
            await asyncio.sleep(self.poll_interval_s)


class NewRecordsTrigger(BaseEventTrigger):
    """The watcher of an event-driven DAG (``microbatch_dag(..., schedule="on_new_data")``):
    an asset event each time the pipeline's topics hold records it has not fired for.

    It runs in the triggerer for as long as the DAG is deployed. Every ``poll_interval_s``
    it compares the Kafka end offsets with the newest checkpoint's offsets
    (:func:`~microbatch_airflow.freshness.check_for_work`, without the idle-timer rule);
    it fires when there is work and the work differs from what it last fired for (the
    same backlog behind the same checkpoint fires once), so the events of one backlog
    coalesce into one run. It never fires on a guess: a check that fails (Kafka or S3
    unreachable, a job file that does not load) is logged and retried with a doubling
    backoff of up to ``max_backoff_s``.

    Exactly-once holds whatever the events do: a run reads exactly the offsets between
    the newest checkpoint and its own end, so a duplicate, stale or late event starts a
    run whose new-data check finds nothing and skips its batch. The event's ``extra`` is
    ``{"status": "new_data", "message", "new_records", "lag", "pipeline"}``.
    """

    def __init__(
        self,
        job: str,
        *,
        env: dict[str, str] | None = None,
        kafka_conn_id: str | None = KAFKA_CONN_ID,
        s3_conn_id: str | None = S3_CONN_ID,
        poll_interval_s: float = 2.0,
        max_backoff_s: float = 60.0,
    ) -> None:
        super().__init__()
        self.job = job
        self.env = dict(env or {})
        self.kafka_conn_id = kafka_conn_id
        self.s3_conn_id = s3_conn_id
        self.poll_interval_s = float(poll_interval_s)
        self.max_backoff_s = float(max_backoff_s)

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (
            f"{type(self).__module__}.{type(self).__qualname__}",
            {
                "job": self.job,
                "env": self.env,
                "kafka_conn_id": self.kafka_conn_id,
                "s3_conn_id": self.s3_conn_id,
                "poll_interval_s": self.poll_interval_s,
                "max_backoff_s": self.max_backoff_s,
            },
        )

    async def run(self) -> AsyncIterator[TriggerEvent]:
        facts = await self._retrying("loading the pipeline", self._facts)
        fired: tuple[Any, ...] | None = None
        while True:
            decision = await self._retrying(
                f"checking pipeline {facts.name!r} for new records",
                lambda: self._check(facts),
            )
            seen = (decision.reason, tuple(sorted(decision.lag.items())))
            if decision.run and seen != fired:
                fired = seen
                self.log.info("pipeline %s: %s: firing", facts.name, decision.reason)
                yield TriggerEvent(decision.event() | {"pipeline": facts.name})
            await asyncio.sleep(self.poll_interval_s)

    async def _facts(self) -> PipelineFacts:
        from microbatch_airflow.operators import load_job_pipeline

        settings = await asettings_from_airflow(self.kafka_conn_id, self.s3_conn_id, None)
        pipeline = await asyncio.to_thread(load_job_pipeline, self.job, settings, self.env)
        self._settings = settings
        return PipelineFacts.from_pipeline(pipeline)

    async def _check(self, facts: PipelineFacts) -> Any:
        now_ms = int(time.time() * 1000)
        return await asyncio.to_thread(check_for_work, facts, self._settings, now_ms, False)

    async def _retrying(self, what: str, attempt: Any) -> Any:
        backoff = self.poll_interval_s
        while True:
            try:
                return await attempt()
            except Exception as exc:
                self.log.warning("%s (%s) failed: %s; retrying in %.0f s", what, self.job,
                                 exc, backoff)  # fmt: skip
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, self.max_backoff_s)


def _error(facts: PipelineFacts, message: str) -> dict[str, Any]:
    return {
        "status": "error",
        "message": f"checking pipeline {facts.name!r} for new data failed: {message}",
        "new_records": 0,
        "lag": {},
    }
