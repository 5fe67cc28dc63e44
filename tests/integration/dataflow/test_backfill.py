"""A backfill of a dataflow: rewinding restores every keyed step's state, each interval's
output is replaced atomically, and the same files come back."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from microbatch.checkpoint import Layout
from microbatch.checkpoint.inspection import inspect_key
from microbatch.dataflow import Dataflow
from microbatch.runtime import KafkaSource, KeyedProcessFunction, ParquetSink
from microbatch.sinks import parquet as ps
from microbatch.storage import open_store
from tests.integration.runtime.test_backfill import USERS, run, topic  # noqa: F401 - fixture

pytestmark = pytest.mark.integration


class ClicksPerUser(KeyedProcessFunction):
    def process(self, key: Any, records: Any, ctx: Any) -> None:
        total = ctx.value("total")
        for r in records:
            total.set(total.get(0) + 1)
            ctx.emit({"user": key, "page": r["page"], "user_total": total.get()})


class VisitsPerPage(KeyedProcessFunction):
    def process(self, key: Any, records: Any, ctx: Any) -> None:
        visits = ctx.value("visits")
        visits.set(visits.get(0) + len(records))
        ctx.emit({"page": key, "visits": visits.get()})


def clicks_dataflow(topic_name: str, root: Path):
    flow = Dataflow("clicks-flow", checkpoints=f"{root}/checkpoints", max_parallelism=8,
                    parallelism=2)  # fmt: skip
    users = (
        flow.source(KafkaSource(topics=(topic_name,)))
        .key_by("user")
        .process(ClicksPerUser(), uid="users")
    )
    users.to(ParquetSink("user_clicks", f"{root}/user_clicks"))
    users.key_by("page").process(VisitsPerPage(), uid="pages").to(
        ParquetSink("pages", f"{root}/pages")
    )
    return flow.build()


def files(root: Path) -> dict[str, list[bytes]]:
    out = {}
    for sink in ("user_clicks", "pages"):
        store = open_store(str(root / sink))
        entries = ps.commit_entries(store)
        out[sink] = [store.get(k) for b in ps.visible_batches(entries) for k in entries[b]["files"]]
    return out


def every_state(root: Path) -> dict[str, Any]:
    store = open_store(str(root / "checkpoints"))
    users = {u: inspect_key(store, Layout(), u).values for u in USERS}
    pages = {p: inspect_key(store, Layout(), p, step="pages").values for p in
             (f"/p{n}" for n in range(12))}  # fmt: skip
    return {"users": users, "pages": pages}


def test_a_backfill_rewinds_every_steps_state_and_rewrites_the_same_files(
    spark,
    kafka_settings,
    topic,  # noqa: F811 - the fixture imported above
    tmp_path: Path,
) -> None:
    name, _ = topic
    flow = clicks_dataflow(name, tmp_path)
    for i in range(4):
        assert run(spark, kafka_settings, flow, i).records_in == 12
    scheduled_files, scheduled_state = files(tmp_path), every_state(tmp_path)
    assert sum(scheduled_state["pages"][p]["visits"] for p in scheduled_state["pages"]) == 48

    first = run(spark, kafka_settings, flow, 1, backfill=True)
    assert first.rewind is not None and first.records_in == 12
    for i in (2, 3):
        run(spark, kafka_settings, flow, i, backfill=True)
    assert files(tmp_path) == scheduled_files
    assert every_state(tmp_path) == scheduled_state
