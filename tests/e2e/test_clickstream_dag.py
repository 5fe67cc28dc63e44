"""The clickstream DAG on the real stack: Airflow 3, Kafka, SeaweedFS, Spark.

One module-scoped run of four ``dag.test()`` calls in a fresh interpreter (Airflow's
config never enters pytest): a committed batch, an idle run that is skipped, a dry run
that commits nothing, and a trigger with a bad param, with Airflow's OpenLineage provider
writing its events to a file. The Microbatch page is then served by Airflow's own API app,
with its login enforced. The batches run on the run's warm Spark Connect server, as
``make airflow``'s do (the smoke DAG of ``test_airflow_dags.py`` covers a cold
``spark-submit`` from a task).
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest

from microbatch.checkpoint import Layout, list_checkpoints
from microbatch.examples.clicks import generate_clicks
from microbatch.examples.clickstream import ClickstreamConfig
from microbatch.examples.profile_service import ProfileService
from microbatch.localstack.topics import create_topics, produce
from microbatch.storage import open_store
from tests.e2e.harness import REPO, run_airflow_script

pytestmark = pytest.mark.e2e

DAG_RUNS = """
import json
from sqlalchemy import select
from airflow.dag_processing.dagbag import DagBag
from airflow.models.asset import AssetEvent, AssetModel
from airflow.models.xcom import XComModel
from airflow.utils.session import create_session
from microbatch.localstack.topics import produce

bag = DagBag(dag_folder=__DAGS__)
dag = bag.get_dag("clickstream")
shape = {"errors": bag.import_errors, "tasks": sorted(dag.task_ids),
         "max_active_runs": dag.max_active_runs, "catchup": dag.catchup,
         "params": {k: dag.params.get_param(k).schema for k in dag.params},
         "outlets": [getattr(a, "uri", None) or a.name for a in dag.get_task("batch").outlets],
         "retries": dag.get_task("batch").retries,
         "backoff": dag.get_task("batch").retry_exponential_backoff}

def summary(run):
    tasks = {ti.task_id: str(ti.state) for ti in run.get_task_instances()}
    with create_session() as s:
        rows = s.scalars(XComModel.get_many(run_id=run.run_id, key="return_value",
                                            dag_ids="clickstream", task_ids="batch")).all()
        events = s.scalars(select(AssetEvent).join(AssetModel, AssetEvent.asset_id == AssetModel.id)
                           .where(AssetModel.uri.like("microbatch://clickstream%"),
                                  AssetEvent.source_run_id == run.run_id)).all()
        outputs = s.execute(select(AssetModel.uri, AssetEvent.extra)
                            .join(AssetModel, AssetEvent.asset_id == AssetModel.id)
                            .where(AssetModel.uri.not_like("microbatch://%"),
                                   AssetEvent.source_run_id == run.run_id)).all()
        return {"state": str(run.state), "tasks": tasks,
                "xcom": XComModel.deserialize_value(rows[0]) if rows else None,
                "events": [e.extra for e in events],
                "output_events": sorted([uri, extra] for uri, extra in outputs)}

import datetime as dt
import time
# A run reads up to the end of its data interval: the interval that ended last before its
# logical date. Logical dates 5 minutes apart from now + 5 min give intervals that end
# after the clicks were produced, one after the other.
first = dt.datetime.now(dt.timezone.utc) + dt.timedelta(minutes=5)
def at(n):
    return first + dt.timedelta(minutes=5 * n)
t0 = time.monotonic()
out = {"shape": shape, "committed": summary(dag.test(logical_date=at(0)))}
t1 = time.monotonic()
out["idle"] = summary(dag.test(logical_date=at(1)))
t2 = time.monotonic()
click = json.dumps({"user_id": "user-x", "page": "/", "ts": 1767225600000}).encode()
produce(__BOOTSTRAP__, __TOPIC__, [(b"user-x", click)] * 5)
out["dry_run"] = summary(dag.test(logical_date=at(2),
                                  run_conf={"dry_run": True, "parallelism": 3}))
out["seconds"] = [round(t1 - t0), round(t2 - t1), round(time.monotonic() - t2)]
try:
    dag.test(logical_date=at(3), run_conf={"parallelism": 0})
    out["bad_param"] = "accepted"
except Exception as exc:
    out["bad_param"] = type(exc).__name__ + ": " + str(exc)
print("RESULT " + json.dumps(out, default=str))
"""

API_APP = """
import json
from fastapi.testclient import TestClient
from airflow.api_fastapi.app import create_app, get_auth_manager
from airflow.api_fastapi.auth.managers.simple.user import SimpleAuthManagerUser
from airflow.dag_processing.bundles.manager import DagBundlesManager
from airflow.dag_processing.dagbag import BundleDagBag, sync_bag_to_db
from airflow.utils.session import create_session

manager = DagBundlesManager()
with create_session() as session:
    manager.sync_bundles_to_db(session=session)
for bundle in manager.get_all_dag_bundles():
    bundle.initialize()
    sync_bag_to_db(BundleDagBag(dag_folder=bundle.path, bundle_path=bundle.path,
                                bundle_name=bundle.name), bundle.name, bundle.version)

client = TestClient(create_app())
token = get_auth_manager().generate_jwt(SimpleAuthManagerUser(username="admin", role="admin"))
bearer = {"Authorization": "Bearer " + token}
out = {}
r = client.get("/microbatch/", headers={"accept": "application/json"})
out["anonymous"] = [r.status_code, r.text]
r = client.get("/microbatch/", headers={"accept": "text/html"}, follow_redirects=False)
out["anonymous_browser"] = [r.status_code, r.headers.get("location")]
r = client.get("/microbatch/api/pipelines", headers={"Authorization": "Bearer not-a-jwt"})
out["bad_token"] = [r.status_code, r.text]
client.cookies.set("_token", token)
r = client.get("/microbatch/", headers={"accept": "text/html"})
out["page"] = [r.status_code, r.text]
client.cookies.clear()
r = client.get("/microbatch/api/pipelines", headers=bearer)
out["json"] = [r.status_code, r.json() if r.status_code == 200 else r.text]
r = client.get("/api/v2/plugins", headers=bearer)
out["plugins"] = [p for p in r.json()["plugins"] if p["name"] == "microbatch"]
r = client.post("/api/v2/dags/clickstream/dagRuns", headers=bearer,
                json={"logical_date": None, "conf": {"parallelism": 0}})
out["bad_param"] = [r.status_code, r.text]
print("RESULT " + json.dumps(out, default=str))
"""


def _result(proc) -> dict:
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert lines, f"script printed no result (exit {proc.returncode}):\n{proc.stderr[-6000:]}"
    return json.loads(lines[-1][len("RESULT ") :])


@pytest.fixture(scope="module")
def pipeline_env(stack_settings, spark_connect, tmp_path_factory):
    """A fresh clickstream namespace with 120-odd clicks, the profile service, and the
    environment of the Airflow scripts (batches on the warm Connect server: no JVM start)."""
    run = uuid.uuid4().hex[:8]
    profiles = ProfileService(1, 0.0, tmp_path_factory.mktemp("profiles") / "service.log")
    config = ClickstreamConfig.fresh(
        stack_settings.s3_bucket,
        "e2e-clickstream",
        f"e2e-{run}",
        profile_url=profiles.url,
        idle_timeout_s=600.0,  # the idle run right after the batch must not see idle partitions
    )
    bootstrap = stack_settings.kafka_bootstrap_servers
    create_topics(bootstrap, {config.topic: 2, config.sessions_topic: 1,
                              config.dead_letter_topic: 1})  # fmt: skip
    clicks = generate_clicks(users=15, hours=2, seed=7)
    produce(bootstrap, config.topic,
            [(c["user_id"].encode(), json.dumps(c).encode()) for c in clicks])  # fmt: skip
    env = stack_settings.to_env() | config.to_env() | {"MICROBATCH_SPARK_MASTER": spark_connect.url}
    yield {"config": config, "clicks": len(clicks), "env": env}
    profiles.stop()


@pytest.fixture(scope="module")
def lineage_file(tmp_path_factory) -> Path:
    """Where the OpenLineage provider's file transport appends the runs' events."""
    return tmp_path_factory.mktemp("openlineage") / "events.jsonl"


@pytest.fixture(scope="module")
def dag_runs(pipeline_env, airflow_home, stack_settings, lineage_file):
    config = pipeline_env["config"]
    code = (
        DAG_RUNS.replace("__DAGS__", repr(str(REPO / "dags")))
        .replace("__BOOTSTRAP__", repr(stack_settings.kafka_bootstrap_servers))
        .replace("__TOPIC__", repr(config.topic))
    )
    transport = {"type": "file", "log_file_path": str(lineage_file), "append": True}
    env = pipeline_env["env"] | {
        "AIRFLOW__OPENLINEAGE__TRANSPORT": json.dumps(transport),
        "AIRFLOW__OPENLINEAGE__NAMESPACE": "microbatch-e2e",
    }
    proc = run_airflow_script(airflow_home, code, env)
    return _result(proc), proc


def test_dagbag_imports_the_clickstream_dag_with_its_params(dag_runs):
    shape = dag_runs[0]["shape"]

    assert shape["errors"] == {}
    assert shape["tasks"] == ["batch", "new_data"]
    assert (shape["max_active_runs"], shape["catchup"]) == (1, False)
    assert (shape["retries"], shape["backoff"]) == (2, 2.0)
    assert shape["params"]["parallelism"] | {"description": ""} == {
        "type": "integer",
        "minimum": 1,
        "maximum": 64,
        "title": "Parallelism",
        "description": "",
    }
    assert shape["outlets"] == ["microbatch://clickstream/", "microbatch.clickstream.outputs"]


def test_scheduled_shape_run_commits_a_batch_pushes_xcom_and_emits_an_asset_event(
    dag_runs, pipeline_env, stack_settings
):
    result, proc = dag_runs
    run = result["committed"]
    print("dag.test seconds (committed, idle, dry run):", result["seconds"])

    assert run["state"] == "success", proc.stderr[-6000:]
    assert run["tasks"] == {"new_data": "success", "batch": "success"}
    xcom = run["xcom"]
    assert xcom["status"] == "committed" and xcom["batch_id"] == 0
    assert xcom["records_in"] == pipeline_env["clicks"]
    assert sum(xcom["lag"].values()) == 0
    (event,) = run["events"]
    assert event["batch_id"] == 0 and event["records_in"] == pipeline_env["clicks"]
    assert event["watermark"] == xcom["watermark"] and event["lag_total"] == 0
    # Each output the batch wrote to got its own event, by the sink's URI (the asset alias).
    by_sink = {extra["sink"]: uri for uri, extra in run["output_events"]}
    written = {sink for sink, rows in xcom["outputs"].items() if rows}
    assert set(by_sink) == written and written, run["output_events"]
    for dataset in xcom["lineage"]["outputs"]:
        if dataset["sink"] in written and dataset["namespace"].startswith("s3://"):
            assert by_sink[dataset["sink"]] == f"{dataset['namespace']}/{dataset['name']}"
    output = proc.stdout + proc.stderr
    assert stack_settings.s3_secret_access_key not in output + json.dumps(result)


def test_run_without_new_data_skips_the_batch(dag_runs):
    result, _ = dag_runs
    run = result["idle"]

    assert run["state"] == "success"
    assert run["tasks"] == {"new_data": "skipped", "batch": "skipped"}
    assert run["xcom"] is None and run["events"] == []


def test_dry_run_param_plans_and_commits_nothing(dag_runs, pipeline_env, stack_settings):
    result, proc = dag_runs
    run = result["dry_run"]

    assert run["state"] == "success", proc.stderr[-6000:]
    assert run["tasks"] == {"new_data": "success", "batch": "success"}
    assert run["xcom"]["status"] == "dry_run" and run["xcom"]["batch_id"] == 1
    assert sum(r["until"] - r["from"] for r in run["xcom"]["ranges"]) == 5
    assert sum(run["xcom"]["lag"].values()) == 5
    assert run["events"] == []
    store = open_store(f"{pipeline_env['config'].root}/checkpoints", stack_settings)
    assert list_checkpoints(store, Layout()) == [0]


def test_openlineage_events_carry_the_topics_the_sinks_and_the_batch(
    dag_runs, lineage_file, pipeline_env, stack_settings
):
    result, proc = dag_runs
    config = pipeline_env["config"]
    assert lineage_file.exists(), f"no OpenLineage event was written:\n{proc.stderr[-4000:]}"
    events = [json.loads(line) for line in lineage_file.read_text().splitlines() if line]
    batches = [
        e for e in events if (e["job"]["name"], e["eventType"]) == ("clickstream.batch", "COMPLETE")
    ]
    by_status = {e["run"]["facets"]["microbatch_batch"]["status"]: e for e in batches}

    assert set(by_status) == {"committed", "dry_run"}, [e["eventType"] for e in events]
    committed = by_status["committed"]
    assert committed["job"]["namespace"] == "microbatch-e2e"
    kafka = f"kafka://{stack_settings.kafka_bootstrap_servers.split(',')[0]}"
    assert [(d["namespace"], d["name"]) for d in committed["inputs"]] == [(kafka, config.topic)]
    outputs = {(d["namespace"], d["name"]): d for d in committed["outputs"]}
    bucket, _, prefix = config.root.removeprefix("s3://").partition("/")
    assert (f"s3://{bucket}", f"{prefix}/sessions") in outputs
    assert (kafka, config.sessions_topic) in outputs
    assert (kafka, config.dead_letter_topic) in outputs
    facet = committed["run"]["facets"]["microbatch_batch"]
    xcom = result["committed"]["xcom"]
    assert facet["batchId"] == facet["checkpointId"] == xcom["batch_id"] == 0
    assert facet["recordsIn"] == xcom["records_in"] == pipeline_env["clicks"]
    assert facet["checkpoints"] == f"{config.root}/checkpoints"
    sessions = outputs[f"s3://{bucket}", f"{prefix}/sessions"]
    assert sessions["outputFacets"]["outputStatistics"]["rowCount"] == xcom["outputs"]["sessions"]
    dry = by_status["dry_run"]
    assert dry["run"]["facets"]["microbatch_batch"]["batchId"] == 1 and dry["outputs"] == []


def test_bad_param_is_refused_before_any_run(dag_runs):
    result, _ = dag_runs

    assert result["bad_param"].startswith("ParamValidationError")
    assert "parallelism" in result["bad_param"]


def test_microbatch_page_requires_an_airflow_login_and_shows_the_pipeline(
    dag_runs, pipeline_env, airflow_home, stack_settings
):
    proc = run_airflow_script(airflow_home, API_APP, pipeline_env["env"])
    result = _result(proc)

    assert result["anonymous"][0] == 401
    assert "clickstream" not in result["anonymous"][1]
    status, location = result["anonymous_browser"]
    assert status in (302, 307) and "/auth/login" in location
    assert result["bad_token"][0] in (401, 403)
    status, html = result["page"]
    assert status == 200, html[-3000:]
    assert 'id="clickstream"' in html and "checkpoint <b>0</b>" in html
    assert "<svg" in html and "<script" not in html
    assert stack_settings.s3_secret_access_key not in html
    status, views = result["json"]
    assert status == 200 and views[0]["latest"]["id"] == 0
    assert sum(p["lag"] for p in views[0]["partitions"]) == 5  # the dry run's 5 clicks
    (plugin,) = result["plugins"]
    assert plugin["external_views"][0]["href"] == "microbatch/"
    assert plugin["fastapi_apps"][0]["url_prefix"] == "/microbatch"
    assert result["bad_param"][0] == 400 and "parallelism" in result["bad_param"][1]
