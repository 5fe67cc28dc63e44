"""The Microbatch page lists pipelines from Airflow's own records and never loads a job
file: a DAG whose job file raises on import is listed, with the facts stored in its
checkpoints, by Airflow's API app over a real metadata database."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from tests.e2e.harness import API_APP_PRELUDE, run_airflow_script
from tests.unit.plugin.test_ui import write_batches

pytestmark = pytest.mark.e2e

PAGE = (
    API_APP_PRELUDE
    + """    # What the batch task records with a committed batch (asset_event_extra).
    session.add(AssetEvent(asset_id=ids["microbatch://exploding/"],
                           extra={"pipeline": "exploding", "batch_id": 1,
                                  "checkpoints": __CHECKPOINTS__, "topics": ["clicks-ui"]}))

client = TestClient(create_app())
token = get_auth_manager().generate_jwt(SimpleAuthManagerUser(username="admin", role="admin"))
bearer = {"Authorization": "Bearer " + token}
page = client.get("/microbatch/", headers=bearer | {"accept": "text/html"})
views = client.get("/microbatch/api/pipelines", headers=bearer)
print("RESULT " + json.dumps({"errors": errors, "assets": sorted(ids),
                              "page": [page.status_code, page.text],
                              "views": [views.status_code, views.json()]}))
"""
)

JOB = """
from pathlib import Path
Path({marker!r}).write_text("the job file was imported")
raise RuntimeError("this job file must never be imported by the API server")
"""

DAG = """
from microbatch_airflow.dag_factory import microbatch_dag

microbatch_dag("exploding", {job!r}, max_parallelism=16, default_parallelism=2)
microbatch_dag("not_yet", {job!r}, pipeline="not_yet", max_parallelism=16,
               default_parallelism=2)
"""


def test_page_lists_a_pipeline_whose_job_raises_on_import_with_its_stored_facts(
    new_airflow_home, tmp_path
):
    home = new_airflow_home("page")
    write_batches(tmp_path / "exploding")
    marker = tmp_path / "imported.txt"
    job = tmp_path / "jobs" / "exploding.py"
    job.parent.mkdir()
    job.write_text(textwrap.dedent(JOB.format(marker=str(marker))))
    dags = tmp_path / "dags"
    dags.mkdir()
    (dags / "exploding.py").write_text(textwrap.dedent(DAG.format(job=str(job))))
    env = {
        "AIRFLOW__CORE__DAGS_FOLDER": str(dags),
        "MICROBATCH_KAFKA_BOOTSTRAP_SERVERS": "127.0.0.1:1",  # lag: unavailable, facts shown
    }
    code = PAGE.replace("__CHECKPOINTS__", repr(str(tmp_path / "exploding" / "checkpoints")))

    proc = run_airflow_script(home, code, env)

    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert lines, f"no result (exit {proc.returncode}):\n{proc.stderr[-5000:]}"
    result = json.loads(lines[-1][len("RESULT ") :])
    assert result["errors"] == {}
    assert {"microbatch://exploding/", "microbatch://not_yet/"} <= set(result["assets"])
    status, html = result["page"]
    assert status == 200, html[-3000:]
    assert not marker.exists(), "rendering the page imported the job file"
    assert "RuntimeError" not in html and "must never be imported" not in html
    assert '<h2 id="exploding">exploding</h2>' in html and "checkpoint <b>1</b>" in html
    assert '<h2 id="not_yet">not_yet</h2>' in html and "no committed batch yet" in html
    status, views = result["views"]
    view = {v["name"]: v for v in views}["exploding"]
    assert view["latest"]["state_keys"] == 10 and view["max_parallelism"] == 16
    assert [c["records_in"] for c in view["checkpoints"]] == [101, 100]
    assert view["errors"] and view["errors"][0].startswith("lag unavailable")
    assert Path(view["checkpoints_url"]) == tmp_path / "exploding" / "checkpoints"
