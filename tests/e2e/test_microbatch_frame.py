"""The Microbatch page as Airflow's UI shows it: inside Airflow's own frame, as the nav
view (``<airflow>/plugin/microbatch``) and as the tab of the ``clickstream`` DAG
(``<airflow>/dags/clickstream/plugin/microbatch-dag``), whose checkpoint link leads to
the drill-down page of the checkpoint the smoke run committed; and which pipelines a
DAG's tab shows, from the assets Airflow records its tasks produce.

Headless Chromium on the run's one ``airflow standalone``
(:func:`tests.e2e.standalone.standalone`); the checkpoint read is the smoke run's
(:func:`tests.e2e.standalone.smoke_run`), not the newest: other tests of the session may
have committed batches (backfills) since.
"""

from __future__ import annotations

import json
import textwrap

import pytest

from tests.e2e.harness import API_APP_PRELUDE, run_airflow_script
from tests.e2e.standalone import DAG_ID, USERNAME, screenshot
from tests.unit.plugin.test_ui import write_batches

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1200)]

FRAME = (  # the iframe Airflow's UI shows an external view in (titled with its name)
    "css selector",
    "iframe[title='Microbatch']",
)


def log_in(chrome, wait, standalone, url: str) -> None:
    """Open ``url`` without a session (the browser is shared by the run) and log in on
    Airflow's login page it leads to."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec

    chrome.get(standalone.url)
    chrome.delete_all_cookies()
    chrome.get(url)
    wait.until(ec.url_contains("/auth/login"))
    wait.until(ec.element_to_be_clickable((By.NAME, "username"))).send_keys(USERNAME)
    chrome.find_element(By.NAME, "password").send_keys(standalone.password)
    chrome.find_element(By.CSS_SELECTOR, "button[type=submit]").click()
    wait.until(lambda driver: "/auth/login" not in driver.current_url)


def enter_frame(chrome, wait) -> None:
    """Switch into the external view's iframe once its page has loaded."""
    from selenium.webdriver.support import expected_conditions as ec

    wait.until(ec.frame_to_be_available_and_switch_to_it(FRAME))
    wait.until(lambda driver: driver.execute_script("return document.readyState") == "complete")
    assert chrome.execute_script("return window.top !== window.self"), "not inside a frame"


def test_the_page_shows_in_airflows_frame_and_the_dag_tab_drills_down_to_a_checkpoint(
    standalone, smoke_run, chrome, tmp_path
):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.wait import WebDriverWait

    wait = WebDriverWait(chrome, 60)
    xcom = smoke_run["xcom"]
    batch_id = xcom["batch_id"]
    checkpoint_link = (
        By.XPATH,
        f"//h2[@id='{DAG_ID}']/following-sibling::h3[.='Checkpoints'][1]"
        f"/following-sibling::table[1]//a[.='{batch_id}']",
    )
    nav_view = f"{standalone.url}/plugin/microbatch"
    try:
        # 1. The nav view: Airflow's page, with the Microbatch page in its frame.
        log_in(chrome, wait, standalone, nav_view)
        chrome.get(nav_view)
        wait.until(ec.presence_of_element_located(FRAME))
        enter_frame(chrome, wait)
        section = wait.until(ec.presence_of_element_located((By.ID, DAG_ID)))
        assert section.tag_name == "h2"
        link = chrome.find_element(*checkpoint_link)
        assert link.get_attribute("href") == (
            f"{standalone.url}/microbatch/pipelines/{DAG_ID}/checkpoints/{batch_id}"
        )
        assert f"signed in as {USERNAME}" in chrome.find_element(By.TAG_NAME, "h1").text
        chrome.switch_to.default_content()
        # Airflow mirrors the frame's location into its own URL (a deep link).
        wait.until(ec.url_contains("/plugin/microbatch/microbatch/"))
        screenshot(chrome, tmp_path, "1-nav-view-in-airflow")

        # 2. The DAG's tab: the pipelines the DAG runs, in the frame of the DAG's page.
        chrome.get(f"{standalone.url}/dags/{DAG_ID}")
        tab_url = f"{standalone.url}/dags/{DAG_ID}/plugin/microbatch-dag"
        tab = wait.until(
            ec.element_to_be_clickable((By.CSS_SELECTOR, "a[href$='/plugin/microbatch-dag']"))
        )
        assert tab.text.strip() == "Microbatch"
        screenshot(chrome, tmp_path, "2-dag-page-with-tab")
        tab.click()
        wait.until(ec.url_to_be(tab_url))
        enter_frame(chrome, wait)
        assert chrome.execute_script("return location.pathname") == f"/microbatch/dags/{DAG_ID}"
        wait.until(ec.presence_of_element_located((By.ID, DAG_ID)))
        assert f"DAG {DAG_ID}" in chrome.find_element(By.TAG_NAME, "h1").text
        chrome.switch_to.default_content()
        screenshot(chrome, tmp_path, "3-dag-tab")

        # 3. Its checkpoint link, followed inside the frame: the drill-down page.
        enter_frame(chrome, wait)
        chrome.find_element(*checkpoint_link).click()
        heading = (By.TAG_NAME, "h1")
        wait.until(ec.text_to_be_present_in_element(heading, f"checkpoint {batch_id}"))
        assert chrome.execute_script("return location.pathname") == (
            f"/microbatch/pipelines/{DAG_ID}/checkpoints/{batch_id}"
        )
        rows = chrome.find_elements(
            By.XPATH, "//h3[@id='ranges']/following-sibling::table[1]//tr[td]"
        )
        shown = [[td.text for td in row.find_elements(By.TAG_NAME, "td")][:4] for row in rows]
        assert [(t, int(p), int(f), int(u)) for t, p, f, u in shown] == [
            (r["topic"], r["partition"], r["from"], r["until"]) for r in xcom["ranges"]
        ]
        assert xcom["ranges"], "the smoke run read nothing"

        def fact(label: str) -> str:
            return chrome.find_element(
                By.XPATH, f"//table[@class='facts']//th[.='{label}']/following-sibling::td"
            ).text

        assert fact("records in") == str(xcom["records_in"])
        assert fact("run id") == f"{DAG_ID}/{smoke_run['run']['dag_run_id']}"
        assert fact("parallelism") == f"{xcom['parallelism']} of max 64"
        chrome.switch_to.default_content()
        assert chrome.current_url == tab_url  # the frame moved, Airflow's page did not
        screenshot(chrome, tmp_path, "4-checkpoint-drill-down")
    finally:
        chrome.switch_to.default_content()
        chrome.delete_all_cookies()  # the next browser test starts logged out, as this one


def test_a_dag_without_a_pipeline_says_so_in_its_tab(standalone, chrome, tmp_path):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.wait import WebDriverWait

    wait = WebDriverWait(chrome, 60)
    tab_url = f"{standalone.url}/dags/microbatch_smoke/plugin/microbatch-dag"
    try:
        log_in(chrome, wait, standalone, tab_url)
        chrome.get(tab_url)
        enter_frame(chrome, wait)
        wait.until(ec.text_to_be_present_in_element((By.TAG_NAME, "body"), "runs no microbatch"))
        text = chrome.find_element(By.TAG_NAME, "body").text
        assert "DAG microbatch_smoke runs no microbatch pipeline" in text
        chrome.switch_to.default_content()
        screenshot(chrome, tmp_path, "dag-tab-without-a-pipeline")
    finally:
        chrome.switch_to.default_content()
        chrome.delete_all_cookies()


DAGS = """
from airflow.providers.standard.operators.empty import EmptyOperator
from airflow.sdk import DAG
from microbatch_airflow.dag_factory import microbatch_dag

microbatch_dag("orders_hourly", {job!r}, pipeline="orders", max_parallelism=16,
               default_parallelism=2)
microbatch_dag("live_dag", {job!r}, pipeline="live", schedule="on_new_data",
               max_parallelism=16, default_parallelism=2)
with DAG("plain", schedule=None):
    EmptyOperator(task_id="nothing")
"""

TABS = (
    API_APP_PRELUDE
    + """    # What the batch task records with a committed batch (asset_event_extra) ...
    for name in ("orders", "live"):
        session.add(AssetEvent(asset_id=ids[f"microbatch://{name}/"],
                               extra={"pipeline": name, "batch_id": 1,
                                      "checkpoints": __CHECKPOINTS__, "topics": ["clicks-ui"]}))
    session.flush()
    # ... and, newer, what the watcher of an event-driven DAG adds to its own asset.
    session.add(AssetEvent(asset_id=ids["microbatch://live/new-records"],
                           extra={"pipeline": "live", "records": 3}))

client = TestClient(create_app())
token = get_auth_manager().generate_jwt(SimpleAuthManagerUser(username="admin", role="admin"))
bearer = {"Authorization": "Bearer " + token}
got = {}
# Each page of pipelines waits ~30 s for the unreachable broker's end offsets: two only.
for path in ("/microbatch/dags/orders_hourly", "/microbatch/dags/plain",
             "/microbatch/api/dags/live_dag", "/microbatch/api/dags/ghost",
             "/microbatch/pipelines/orders/checkpoints/1",
             "/microbatch/api/pipelines/orders/checkpoints/1",
             "/microbatch/api/pipelines/orders/checkpoints/5"):
    r = client.get(path, headers=bearer)
    got[path] = [r.status_code, r.json() if "/api/" in path else r.text]
print("RESULT " + json.dumps({"errors": errors, "assets": sorted(ids), "got": got}))
"""
)


def test_a_dags_tab_finds_its_pipeline_by_the_asset_its_task_produces(new_airflow_home, tmp_path):
    """Over a real metadata database: a DAG whose id is not its pipeline's name, an
    event-driven DAG (its watched asset is no pipeline), a DAG without any."""
    home = new_airflow_home("tabs")
    write_batches(tmp_path / "orders")  # checkpoints 0 and 1, as test_ui writes them
    job = tmp_path / "jobs" / "orders.py"
    job.parent.mkdir()
    job.write_text("raise RuntimeError('the page must not import a job file')\n")
    dags = tmp_path / "dags"
    dags.mkdir()
    (dags / "tabs.py").write_text(textwrap.dedent(DAGS.format(job=str(job))))
    env = {
        "AIRFLOW__CORE__DAGS_FOLDER": str(dags),
        "MICROBATCH_KAFKA_BOOTSTRAP_SERVERS": "127.0.0.1:1",  # lag: unavailable, facts shown
    }
    code = TABS.replace("__CHECKPOINTS__", repr(str(tmp_path / "orders" / "checkpoints")))

    proc = run_airflow_script(home, code, env)

    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert lines, f"no result (exit {proc.returncode}):\n{proc.stderr[-5000:]}"
    result = json.loads(lines[-1][len("RESULT ") :])
    assert result["errors"] == {}
    assert "microbatch://live/new-records" in result["assets"]
    got = result["got"]
    status, html = got["/microbatch/dags/orders_hourly"]
    assert status == 200 and '<h2 id="orders">orders</h2>' in html, html[-3000:]
    assert "checkpoint <b>1</b>" in html and "Microbatch · DAG orders_hourly" in html
    assert 'id="live"' not in html  # only the pipeline this DAG runs
    status, html = got["/microbatch/dags/plain"]
    assert status == 200 and "DAG plain runs no microbatch pipeline" in html
    # The event-driven DAG's watched asset is no pipeline, and its newer event does not
    # hide where the pipeline's checkpoints are.
    status, body = got["/microbatch/api/dags/live_dag"]
    assert status == 200 and [p["name"] for p in body["pipelines"]] == ["live"]
    assert body["pipelines"][0]["latest"]["id"] == 1
    status, body = got["/microbatch/api/dags/ghost"]
    assert status == 404 and "Airflow knows no DAG 'ghost'" in body["detail"]
    status, html = got["/microbatch/pipelines/orders/checkpoints/1"]
    assert status == 200 and "orders · checkpoint 1" in html
    status, view = got["/microbatch/api/pipelines/orders/checkpoints/1"]
    assert status == 200 and view["stats"]["records_in"] == 101
    # The batch's plan is not stored: its ranges start where checkpoint 0 ended.
    assert view["ranges_from"] == "checkpoint 0's offsets"
    assert [(r["topic"], r["partition"], r["from"], r["until"]) for r in view["ranges"]] == [
        ("clicks-ui", 0, 40, 41)
    ]
    status, body = got["/microbatch/api/pipelines/orders/checkpoints/5"]
    assert status == 404 and "pipeline 'orders' has no checkpoint 5" in body["detail"]
