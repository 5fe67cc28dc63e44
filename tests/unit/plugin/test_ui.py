"""The Microbatch page over real checkpoints (written with the checkpoint API on a local
store, no Spark), and its refusal of requests without an Airflow login. The page knows a
pipeline by its name and checkpoint location (``PipelineRef``), never by its job file:
``tests/e2e/test_microbatch_page.py`` lists them from a real Airflow database."""

from __future__ import annotations

from pathlib import Path

import pytest
from fastapi import Request
from fastapi.testclient import TestClient

from microbatch import Settings
from microbatch.checkpoint import Layout, checkpoint, latest_manifest
from microbatch.kafka import TopicPartition
from microbatch.keygroups import key_group, key_group_range, operator_index
from microbatch.state import KeyedStateBackend
from microbatch.storage import open_store
from microbatch_airflow.ui.app import airflow_user, create_app
from microbatch_airflow.ui.catalog import PipelineRef, merge, refs_from_config, refs_from_events
from microbatch_airflow.ui.render import MAX_BARS, key_group_chart, page

MAXP, P = 16, 2
ENDS = {TopicPartition("clicks-ui", 0): 50, TopicPartition("clicks-ui", 1): 17}
SECRET = "s3cr3t-never-shown"
SETTINGS = Settings.from_env(env={}, s3_secret_access_key=SECRET)


def write_batches(root: Path) -> None:
    """Two checkpoints of a 'clickstream' pipeline with state in a few key-groups."""
    store = open_store(f"{root}/checkpoints")
    base = None
    for cid, users in ((0, 6), (1, 10)):
        backends = [KeyedStateBackend(MAXP, key_group_range(MAXP, P, i)) for i in range(P)]
        for u in range(users):
            key = f"user-{u}"
            ctx = backends[operator_index(key_group(key, MAXP), MAXP, P)].for_key(key)
            ctx.value("sessions").set([{"start": u, "pages": ["/home"] * (u + 1)}])
        metadata = {
            "offsets": {"clicks-ui": {"0": 40 + cid, "1": 17}},
            "watermark": 1_767_225_600_000 + cid * 60_000,
            "batch": {"processing_time_ms": 1_767_225_600_000 + cid * 300_000, "replayed": False},
            "stats": {
                "records_in": 100 + cid,
                "dead_letters": 3,
                "seconds": {"plan": 0.2, "to_commit": 4.25 + cid},
                "instances": [
                    {"instance": i, "seconds": {"restore": 0.1, "process": 0.5 + i}}
                    for i in range(P)
                ],
            },
        }
        base = checkpoint(store, Layout(), backends, cid, base=base, pipeline_fingerprint="fp",
                          metadata=metadata)  # fmt: skip


@pytest.fixture
def ref(tmp_path: Path) -> PipelineRef:
    root = tmp_path / "clickstream"
    write_batches(root)
    return PipelineRef("clickstream", f"{root}/checkpoints", ("clicks-ui",))


async def signed_in(request: Request) -> str:
    return "tester"  # stands in for Airflow's login in rendering tests (see test_airflow_ui)


def end_offsets_from(ends: dict):
    return lambda settings: lambda tps: {tp: ends[tp] for tp in tps}


def client(*refs: PipelineRef, **kwargs) -> TestClient:
    app = create_app(
        lambda: list(refs),
        authenticate=kwargs.pop("authenticate", signed_in),
        settings=lambda: SETTINGS,
        end_offsets=kwargs.pop("end_offsets", end_offsets_from(ENDS)),
    )
    return TestClient(app)


def test_page_shows_checkpoints_lag_watermark_timings_and_key_group_chart(ref, tmp_path):
    html = client(ref).get("/").text

    assert '<h2 id="clickstream">clickstream</h2>' in html
    assert "checkpoint <b>1</b>" in html
    assert "watermark <b>2026-01-01T00:01:00+00:00</b>" in html
    assert "<td>clicks-ui[0]</td><td>41</td><td>50</td><td>9</td>" in html  # lag 9
    assert "<td>clicks-ui[1]</td><td>17</td><td>17</td><td>0</td>" in html
    assert "<td>1</td><td>" in html and "<td>101</td><td>3</td>" in html  # records, dead
    assert "<td>300.0</td>" in html  # 5 minutes between the two batches
    assert "process 1.5, restore 0.1" in html  # the slowest instance's phases
    assert "<td>5.25</td>" in html  # batch 1 took 5.25 s from plan to commit
    assert html.count("<rect ") == MAXP
    assert "<script" not in html and "http://" not in html.replace("http://www.w3.org", "")


def test_json_endpoint_returns_the_same_data(ref):
    views = client(ref).get("/api/pipelines").json()

    (view,) = views
    assert [c["id"] for c in view["checkpoints"]] == [1, 0]
    assert view["latest"]["state_keys"] == 10
    store = open_store(view["checkpoints_url"])
    assert view["latest"]["state_bytes"] == latest_manifest(store, Layout()).total_bytes
    assert sum(g["keys"] for g in view["key_groups"]) == 10


def test_unreachable_kafka_still_shows_checkpoints_with_the_error(ref):
    def broken(settings):
        def end_offsets(tps):
            raise ConnectionError("brokers at 127.0.0.1:1 unreachable")

        return end_offsets

    html = client(ref, end_offsets=broken).get("/").text

    assert "lag unavailable: brokers at 127.0.0.1:1 unreachable" in html
    assert "checkpoint <b>1</b>" in html


def test_a_config_entry_that_is_a_job_file_shows_why_it_is_not_loaded():
    (bad,) = refs_from_config("jobs/clickstream.py")

    html = client(bad).get("/").text

    assert "is not name=checkpoint_url" in html and "does not load job files" in html


def test_a_pipeline_without_a_committed_batch_is_listed_without_facts():
    html = client(PipelineRef("fresh")).get("/").text

    assert '<h2 id="fresh">fresh</h2>' in html and "no committed batch yet" in html


def test_two_dags_running_one_job_on_two_namespaces_are_two_pipelines_named_by_asset():
    # Both jobs name their Pipeline "clickstream"; each DAG declared its own asset.
    events = [
        ("microbatch://clickstream/", {"pipeline": "clickstream", "checkpoints": "s3://b/main"}),
        ("microbatch://clickstream_live/", {"pipeline": "clickstream",
                                            "checkpoints": "s3://b/live"}),
    ]  # fmt: skip

    refs = merge(refs_from_events(events), [])

    assert [(r.name, r.checkpoints) for r in refs] == [
        ("clickstream", "s3://b/main"),
        ("clickstream_live", "s3://b/live"),
    ]


def test_refs_come_from_asset_events_and_a_configured_location_wins(ref, tmp_path):
    events = [
        ("microbatch://clickstream", {"pipeline": "clickstream", "checkpoints": "s3://b/old",
                                      "topics": ["clicks-ui"]}),
        ("microbatch://fresh", None),
        ("s3://not-a-pipeline/x", {"checkpoints": "s3://b/x"}),
    ]  # fmt: skip

    refs = merge(refs_from_events(events), refs_from_config(f"clickstream={ref.checkpoints}"))

    assert refs == [ref, PipelineRef("fresh")]
    views = client(*refs).get("/api/pipelines").json()
    assert [(v["name"], v["latest"] and v["latest"]["id"]) for v in views] == [
        ("clickstream", 1),
        ("fresh", None),
    ]
    assert views[0]["max_parallelism"] == MAXP


def test_no_secret_reaches_the_page_or_the_json(ref):
    c = client(ref)

    assert SECRET not in c.get("/").text
    assert SECRET not in c.get("/api/pipelines").text


@pytest.mark.parametrize("path", ["/", "/api/pipelines"])
def test_requests_without_an_airflow_login_are_refused(ref, path):
    c = client(ref, authenticate=airflow_user)

    response = c.get(path, headers={"accept": "application/json"})

    assert response.status_code == 401
    assert response.headers["www-authenticate"] == "Bearer"
    assert "clickstream" not in response.text


def test_chart_buckets_many_key_groups_and_escapes_labels():
    groups = [{"key_group": i, "bytes": i % 7, "keys": 1} for i in range(4096)]

    svg = key_group_chart(groups, parallelism=4)

    assert svg.count("<rect ") == MAX_BARS
    assert "key-groups 0-15" in svg


def test_page_escapes_names():
    html = page([{"name": "<x>", "errors": ["<script>alert(1)</script>"]}])

    assert "<script>" not in html and "&lt;script&gt;" in html
