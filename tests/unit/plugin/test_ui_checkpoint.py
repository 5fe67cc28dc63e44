"""The drill-down page of a checkpoint, a DAG's tab and the plugin's external views, over
real checkpoints and plans written with the library on a local store (no services).

The checkpoints of pipeline ``clicks``: 0, the first batch (its plan stored); 1, whose plan
retention removed (its ranges come from checkpoint 0, plus offsets it skipped); 2, a
rewind's copy of 0 that undid 1; 3, the batch after the copy, replaying its stored plan.
``tests/e2e/test_microbatch_frame.py`` shows the same pages inside Airflow's own UI.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from urllib.parse import quote, urljoin

import pytest
from fastapi import FastAPI, Request
from fastapi.testclient import TestClient

from microbatch import Settings
from microbatch.checkpoint import Layout, checkpoint, empty_backends, load_manifest
from microbatch.kafka.offsets import OffsetRange, TopicPartition
from microbatch.kafka.planner import BatchPlan, PlanStore
from microbatch.keygroups import key_group, operator_index
from microbatch.runtime.records import (
    BatchInfo,
    BatchRecord,
    BatchStats,
    InstanceStats,
    PartitionCounts,
    ReplayOrigin,
)
from microbatch.storage import open_store
from microbatch_airflow.plugin import MicrobatchPlugin
from microbatch_airflow.ui.app import airflow_user, create_app
from microbatch_airflow.ui.catalog import PipelineRef, pipeline_of_uri, refs_from_events
from microbatch_airflow.ui.checkpoint import checkpoint_view
from microbatch_airflow.ui.render_checkpoint import checkpoint_page

TOPIC = "clicks-cp"
P0, P1 = TopicPartition(TOPIC, 0), TopicPartition(TOPIC, 1)
MAXP, P = 8, 2
T0 = 1_767_225_600_000  # 2026-01-01T00:00:00Z
SECRET = "s3cr3t-never-shown"
SETTINGS = Settings.from_env(env={}, s3_secret_access_key=SECRET)
ENDS = {P0: 60, P1: 20}


def stats(records: dict[TopicPartition, int], **kwargs) -> BatchStats:
    """What a batch counted: per partition records, two instances with their phases."""
    per = {f"{tp.topic}/{tp.partition}": PartitionCounts(n, n, 0) for tp, n in records.items()}
    instances = tuple(
        InstanceStats(i, {"records": 10 + i, "keys": 3}, {"restore": 0.1, "process": 0.5 + i})
        for i in range(P)
    )
    return BatchStats(records_in=sum(records.values()), per_partition=per, instances=instances,
                      seconds={"plan": 0.2, "to_commit": 4.25}, **kwargs)  # fmt: skip


def commit(store, cid: int, base, record: BatchRecord, keys: int = 4):
    backends = empty_backends(MAXP, P)
    for k in range(keys):
        key = f"user-{k}"
        backends[operator_index(key_group(key, MAXP), MAXP, P)].for_key(key).value("n").set(k)
    return checkpoint(store, Layout(), backends, cid, base=base, pipeline_fingerprint="fp",
                      metadata=record.to_json())  # fmt: skip


def plan(cid: int, start: dict, until: dict, skipped: dict | None = None) -> BatchPlan:
    ranges = tuple(
        OffsetRange(tp.topic, tp.partition, start[tp], until[tp])
        for tp in start
        if until[tp] > start[tp]
    )
    return BatchPlan("clicks", cid, start, ranges, skipped=skipped or {}, created_at=T0)


def write_lineage(url: str) -> None:
    store = open_store(url)
    plans = PlanStore(store)
    # 0: the first batch, planned from offset 0 of both partitions.
    first = {P0: 0, P1: 0}
    plans.save(plan(0, first, {P0: 40, P1: 17}))
    info0 = BatchInfo(
        parallelism=P, processing_time_ms=T0, interval_start_ms=T0 - 300_000,
        until_timestamp_ms=T0, base_checkpoint=None, from_offsets={TOPIC: {"0": 0, "1": 0}},
        run_id="clicks/manual__0",
    )  # fmt: skip
    counted = stats({P0: 40, P1: 17}, dead_letters=2, dead_letter_reasons={"malformed": 2},
                    outputs={"sessions": 12, "clicks.dlq": 2}, reader="spark")  # fmt: skip
    record0 = BatchRecord(offsets={P0: 40, P1: 17}, batch=info0, watermark=T0 - 60_000,
                          supersedes=(), awaiting_replacement={}, stats=counted)  # fmt: skip
    m0 = commit(store, 0, None, record0)
    # 1: its plan is gone (retention); it skipped 5 offsets retention had deleted.
    info1 = dataclasses.replace(info0, processing_time_ms=T0 + 300_000, base_checkpoint=0,
                                from_offsets=None, run_id="clicks/manual__1",
                                interval_start_ms=T0, until_timestamp_ms=T0 + 300_000)  # fmt: skip
    record1 = BatchRecord(offsets={P0: 55, P1: 17}, batch=info1, watermark=T0 + 60_000,
                          supersedes=(), awaiting_replacement={},
                          stats=stats({P0: 10}, skipped={TOPIC: {"0": 5}}))  # fmt: skip
    m1 = commit(store, 1, m0, record1, keys=6)
    # 2: a rewind's copy of checkpoint 0, undoing checkpoint 1 (whose output awaits).
    copy = dataclasses.replace(
        BatchRecord.of(m0), sinks=None, stats=None, supersedes=None,
        replayed_from=ReplayOrigin(0, (1, 1)),
        awaiting_replacement={"1": {f"{TOPIC}/0": 55, f"{TOPIC}/1": 17}},
    )  # fmt: skip
    m2 = commit(store, 2, m1, copy)
    # 3: the batch after the copy, replaying the plan an earlier attempt stored.
    plans.save(plan(3, {P0: 40, P1: 17}, {P0: 60, P1: 20}))
    info3 = dataclasses.replace(info1, base_checkpoint=2, replayed=True, run_id="clicks/bf__3")
    record3 = BatchRecord(offsets={P0: 60, P1: 20}, batch=info3, watermark=T0 + 120_000,
                          supersedes=(1,), awaiting_replacement={},
                          stats=stats({P0: 20, P1: 3}))  # fmt: skip
    commit(store, 3, m2, record3, keys=7)


@pytest.fixture
def ref(tmp_path: Path) -> PipelineRef:
    url = f"{tmp_path}/clicks/checkpoints"
    write_lineage(url)
    return PipelineRef("clicks", url, (TOPIC,))


async def signed_in(request: Request) -> str:
    return "tester"


def client(*refs: PipelineRef, dags: dict | None = None, **kwargs) -> TestClient:
    """The app mounted at ``/microbatch`` as Airflow mounts it, so relative links resolve
    as in a browser."""
    app = create_app(
        lambda: list(refs),
        authenticate=kwargs.pop("authenticate", signed_in),
        settings=lambda: SETTINGS,
        end_offsets=lambda settings: lambda tps: {tp: ENDS[tp] for tp in tps},
        dag_pipeline_names=lambda dag_id: (dags or {}).get(dag_id),
    )
    airflow = FastAPI()
    airflow.mount("/microbatch", app)
    return TestClient(airflow)


def ranges_of(view: dict) -> list[tuple]:
    return [(r["topic"], r["partition"], r["from"], r["until"]) for r in view["ranges"]]


# ------------------------------------------------------------------ the view's data


def test_checkpoint_view_reads_ranges_stats_and_batch_from_the_stored_plan(ref):
    view = checkpoint_view("clicks", ref.checkpoints, 0, SETTINGS)

    assert ranges_of(view) == [(TOPIC, 0, 0, 40), (TOPIC, 1, 0, 17)]
    assert view["ranges_from"] == "the batch's stored plan"
    assert [r["records"] for r in view["ranges"]] == [40, 17]
    assert view["offsets"] == [{"topic": TOPIC, "partition": 0, "offset": 40},
                               {"topic": TOPIC, "partition": 1, "offset": 17}]  # fmt: skip
    assert view["stats"]["records_in"] == 57
    assert view["stats"]["outputs"] == {"sessions": 12, "clicks.dlq": 2}
    assert view["stats"]["dead_letter_reasons"] == {"malformed": 2}
    assert view["stats"]["seconds"] == {"plan": 0.2, "to_commit": 4.25}
    assert [i["seconds"]["process"] for i in view["stats"]["instances"]] == [0.5, 1.5]
    assert view["watermark_iso"] == "2025-12-31T23:59:00+00:00"
    assert view["batch"]["run_id"] == "clicks/manual__0"
    assert view["batch"]["base_checkpoint"] is None and view["batch"]["replayed"] is False
    assert view["batch"]["interval_end"] == "2026-01-01T00:00:00+00:00"
    assert (view["previous"], view["next"]) == (None, 1)
    store = open_store(ref.checkpoints)
    assert view["state_keys"] == load_manifest(store, Layout(), 0).total_keys == 4


def test_without_its_plan_the_ranges_start_where_the_base_checkpoint_ended(ref):
    view = checkpoint_view("clicks", ref.checkpoints, 1, SETTINGS)

    # Checkpoint 0 ended partition 0 at 40; 5 offsets retention had deleted were skipped.
    assert ranges_of(view) == [(TOPIC, 0, 45, 55)]  # partition 1 read nothing
    assert view["ranges"][0]["skipped"] == 5 and view["ranges"][0]["offsets"] == 10
    assert view["ranges_from"] == "checkpoint 0's offsets"
    assert (view["previous"], view["next"]) == (0, 2)


def test_a_rewind_copy_reads_nothing_and_records_what_it_undid(ref):
    view = checkpoint_view("clicks", ref.checkpoints, 2, SETTINGS)

    assert view["ranges"] == [] and "copy made by a rewind" in view["ranges_from"]
    assert view["stats"] is None
    assert view["rewind"]["replayed_from"] == {"checkpoint_id": 0, "undone": [1, 1]}
    assert view["rewind"]["copy_of"] == 0
    assert view["rewind"]["awaiting_replacement"] == [
        {"batch": 1, "ends": {f"{TOPIC}/0": 55, f"{TOPIC}/1": 17}}
    ]
    assert view["batch"]["run_id"] == "clicks/manual__0"  # the copy stands for checkpoint 0


def test_the_batch_after_a_rewind_starts_at_the_copy_and_replaces_the_undone_output(ref):
    view = checkpoint_view("clicks", ref.checkpoints, 3, SETTINGS)

    assert ranges_of(view) == [(TOPIC, 0, 40, 60), (TOPIC, 1, 17, 20)]
    assert view["batch"]["base_checkpoint"] == 2 and view["batch"]["replayed"] is True
    assert view["rewind"]["supersedes"] == [1] and view["rewind"]["replayed_from"] is None


# ------------------------------------------------------------------ the pages


def test_drill_down_page_shows_ranges_stats_watermark_run_and_lineage(ref):
    response = client(ref).get("/microbatch/pipelines/clicks/checkpoints/3")
    html = response.text

    assert response.status_code == 200
    assert "<h1>clicks · checkpoint 3" in html
    assert f"<tr><td>{TOPIC}</td><td>0</td><td>40</td><td>60</td><td>20</td><td>20</td>" in html
    assert f"<tr><td>{TOPIC}</td><td>1</td><td>17</td><td>20</td><td>3</td><td>3</td>" in html
    assert "<tr><th>records in</th><td>23</td></tr>" in html
    assert "<tr><th>run id</th><td>clicks/bf__3</td></tr>" in html
    assert "<tr><th>parallelism</th><td>2 of max 8</td></tr>" in html
    assert "2026-01-01T00:02:00+00:00 (1767225720000 ms)" in html  # the watermark
    assert "process 1.5, restore 0.1" in html  # instance 1's phases
    assert 'started from checkpoint <a href="../../../pipelines/clicks/checkpoints/2">2</a>' in html
    assert "replayed: yes, the plan an earlier attempt stored" in html
    assert "replaced the output of undone batches 1" in html
    assert '<a href="2">← checkpoint 2</a>' in html and "checkpoint 4" not in html
    assert "<script" not in html and SECRET not in html


def test_drill_down_of_a_copy_shows_the_rewind_and_the_output_awaiting_replacement(ref):
    html = client(ref).get("/microbatch/pipelines/clicks/checkpoints/2").text

    source = '<a href="../../../pipelines/clicks/checkpoints/0">0</a>'
    assert f"replayed_from: a rewind's copy of checkpoint {source}, undoing checkpoints 1–1" in html
    assert f"<tr><td>1</td><td>{TOPIC}/0 55, {TOPIC}/1 17</td></tr>" in html
    assert "no stats: a copy made by a rewind or reshard" in html
    assert "<th>a copy of</th><td>checkpoint 0: the batch facts are that batch&#x27;s" in html


def test_json_twin_returns_the_view(ref):
    body = client(ref).get("/microbatch/api/pipelines/clicks/checkpoints/1").json()

    assert body == checkpoint_view("clicks", ref.checkpoints, 1, SETTINGS)
    assert SECRET not in str(body)


def test_each_checkpoint_on_the_pipeline_page_links_to_its_drill_down(ref):
    c = client(ref)
    page_url = "http://testserver/microbatch/"
    html = c.get(page_url).text

    for cid in (3, 2, 1, 0):
        href = f"pipelines/clicks/checkpoints/{cid}"
        assert f'<td><a href="{href}">{cid}</a></td>' in html
        followed = c.get(urljoin(page_url, href))
        assert followed.status_code == 200 and f"clicks · checkpoint {cid}" in followed.text
    back = c.get(urljoin(f"{page_url}pipelines/clicks/checkpoints/3", "../../../"))
    assert back.url == page_url and '<h2 id="clicks">' in back.text


@pytest.mark.parametrize(
    ("path", "named"),
    [
        ("/pipelines/nope/checkpoints/0", "no pipeline &#x27;nope&#x27;"),
        ("/pipelines/clicks/checkpoints/9", "has no checkpoint 9 in"),
        ("/pipelines/clicks/checkpoints/abc", "has no checkpoint &#x27;abc&#x27;"),
        ("/pipelines/fresh/checkpoints/0", "&#x27;fresh&#x27; has no committed batch yet"),
        ("/pipelines/%3Cscript%3E/checkpoints/0", "no pipeline &#x27;&lt;script&gt;&#x27;"),
    ],
)
def test_unknown_pipeline_or_checkpoint_is_a_404_page_naming_it(ref, path, named):
    response = client(ref, PipelineRef("fresh")).get(f"/microbatch{path}")

    assert response.status_code == 404
    assert named in response.text and "<script>" not in response.text
    assert '<a href="../../../">all pipelines</a>' in response.text


def test_unknown_checkpoint_json_is_a_404_with_the_retained_ids(ref):
    response = client(ref).get("/microbatch/api/pipelines/clicks/checkpoints/7")

    assert response.status_code == 404
    detail = response.json()["detail"]
    assert "pipeline 'clicks' has no checkpoint 7" in detail
    assert "committed checkpoints: 0–3" in detail and "Pick a checkpoint" in detail


def test_an_unreadable_store_is_a_502_naming_the_pipeline_and_location(tmp_path):
    broken = PipelineRef("clicks", "s3://", (TOPIC,))  # no bucket: the store cannot open

    response = client(broken).get("/microbatch/api/pipelines/clicks/checkpoints/0")

    assert response.status_code == 502
    assert "cannot read checkpoint 0 of pipeline 'clicks' at s3://" in response.json()["detail"]


def test_drill_down_escapes_everything_it_renders(ref):
    view = checkpoint_view("<b>x</b>", ref.checkpoints, 2, SETTINGS) | {
        "checkpoints_url": "s3://b/<script>", "ranges_from": "<i>", "created_at": "<img src=x>"
    }  # fmt: skip

    html = checkpoint_page(view, user="<u>")

    assert "<b>x</b>" not in html and "&lt;b&gt;x&lt;/b&gt;" in html
    assert "<script>" not in html and "<i>" not in html and "<img" not in html
    assert "<u>" not in html and "%3Cb%3Ex%3C%2Fb%3E/checkpoints/0" in html


# ------------------------------------------------------------------ a DAG's tab


def test_dag_tab_shows_the_pipelines_the_dag_runs_with_links_to_checkpoints(ref):
    c = client(ref, PipelineRef("other"), dags={"clicks_dag": ["clicks"]})
    page_url = "http://testserver/microbatch/dags/clicks_dag"

    html = c.get(page_url).text

    assert "Microbatch · DAG clicks_dag" in html
    assert '<h2 id="clicks">clicks</h2>' in html and 'id="other"' not in html
    assert "checkpoint <b>3</b>" in html
    href = "../pipelines/clicks/checkpoints/0"
    assert f'<td><a href="{href}">0</a></td>' in html
    assert "clicks · checkpoint 0" in c.get(urljoin(page_url, href)).text
    views = c.get("/microbatch/api/dags/clicks_dag").json()
    assert [v["name"] for v in views["pipelines"]] == ["clicks"]


def test_a_dag_without_a_pipeline_gets_a_page_saying_so(ref):
    c = client(ref, dags={"plain": []})

    response = c.get("/microbatch/dags/plain")

    assert response.status_code == 200
    assert "DAG plain runs no microbatch pipeline" in response.text
    assert c.get("/microbatch/api/dags/plain").json() == {"dag_id": "plain", "pipelines": []}


def test_a_dag_whose_pipeline_has_no_batch_yet_lists_it_without_facts(ref):
    html = client(ref, dags={"new": ["brand-new"]}).get("/microbatch/dags/new").text

    assert '<h2 id="brand-new">brand-new</h2>' in html and "no committed batch yet" in html


def test_an_unknown_dag_is_a_404_naming_it(ref):
    c = client(ref)

    response = c.get("/microbatch/dags/ghost")

    assert response.status_code == 404 and "Airflow knows no DAG &#x27;ghost&#x27;" in response.text
    assert c.get("/microbatch/api/dags/ghost").status_code == 404


@pytest.mark.parametrize(
    "path",
    ["/dags/clicks_dag", "/api/dags/clicks_dag", "/pipelines/clicks/checkpoints/0",
     "/api/pipelines/clicks/checkpoints/0"],
)  # fmt: skip
def test_new_routes_refuse_requests_without_an_airflow_login(ref, path):
    c = client(ref, dags={"clicks_dag": ["clicks"]}, authenticate=airflow_user)

    response = c.get(f"/microbatch{path}", headers={"accept": "application/json"})

    assert response.status_code == 401 and "clicks" not in response.text


# ------------------------------------------------------------------ Airflow's records


def test_only_a_pipelines_own_asset_names_it_not_its_new_records_asset():
    events = [
        ("microbatch://live/", {"pipeline": "live", "checkpoints": "s3://b/live"}),
        # The event-driven DAG's watched asset: its events record no checkpoints.
        ("microbatch://live/new-records", {"pipeline": "live", "records": 3}),
    ]

    assert refs_from_events(events) == [PipelineRef("live", "s3://b/live")]
    assert pipeline_of_uri("microbatch://live") == "live"
    assert pipeline_of_uri("microbatch://live/new-records") is None
    assert pipeline_of_uri("s3://live/") is None


# ------------------------------------------------------------------ the plugin's views


def test_plugin_registers_a_nav_view_and_a_dag_tab_airflow_accepts(ref):
    from airflow.api_fastapi.core_api.datamodels.plugins import ExternalViewResponse

    views = [ExternalViewResponse.model_validate(v) for v in MicrobatchPlugin.external_views]

    nav, tab = views
    assert (nav.destination, nav.href, nav.url_route) == ("nav", "microbatch/", "microbatch")
    assert (tab.destination, tab.href) == ("dag", "microbatch/dags/{DAG_ID}")
    assert tab.url_route == "microbatch-dag"  # unique: Airflow drops a view whose route repeats
    # Airflow's UI puts the URL-encoded DAG id in and resolves the href against its <base
    # href> (Airflow's base URL, where the app is mounted): the tab loads the DAG's page.
    src = urljoin("http://testserver/", tab.href.replace("{DAG_ID}", quote("clicks_dag", safe="")))
    response = client(ref, dags={"clicks_dag": ["clicks"]}).get(src)
    assert response.status_code == 200 and '<h2 id="clicks">clicks</h2>' in response.text
    assert client(ref).get(urljoin("http://testserver/", nav.href)).status_code == 200
