"""The deferrable check "is there anything for the next batch?" (see ``freshness``).

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

from airflow.triggers.base import BaseTrigger, TriggerEvent

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


def _error(facts: PipelineFacts, message: str) -> dict[str, Any]:
    return {
        "status": "error",
        "message": f"checking pipeline {facts.name!r} for new data failed: {message}",
        "new_records": 0,
        "lag": {},
    }
