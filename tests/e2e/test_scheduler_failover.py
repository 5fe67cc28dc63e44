"""Airflow's scheduler dies mid-batch; the next scheduler picks the run up and the batch
commits once.

The run's ``airflow standalone`` runs one scheduler (LocalExecutor: the batch task runs
under it). Once the batch of a manual run of ``clickstream_failover`` (a fresh namespace)
has stored its plan, the scheduler and every process under it — the task and the batch's
job process, a client of the warm Spark Connect server — are SIGKILLed: the crash of the
scheduler's machine, the batch half done. A second scheduler, started next on the same
PostgreSQL metadata DB (Airflow supports several on PostgreSQL), finds the first one's
heartbeat stale, resets its orphaned task, and runs it again; the new try takes the lease
over (same run id) and replays the stored plan. The second scheduler then stays the
instance's scheduler until the end of the run (this module runs after the other users of
the instance).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import os
import signal
import subprocess
import time
from pathlib import Path
from urllib.parse import quote

import pytest

from microbatch.checkpoint import Layout, list_checkpoints
from microbatch.storage import open_store
from tests.e2e.harness import VENV_BIN, utcnow
from tests.e2e.standalone import FAILOVER_DAG_ID

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]


def _children() -> dict[int, list[int]]:
    tree: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        tree.setdefault(ppid, []).append(int(entry.name))
    return tree


def _descendants(pid: int) -> list[int]:
    tree, out, todo = _children(), [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += tree.get(p, [])
    return out


def _scheduler_pid(standalone_pid: int) -> int:
    """The ``airflow scheduler`` process ``airflow standalone`` started."""
    for pid in _descendants(standalone_pid):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"scheduler" in argv and any(a.endswith(b"airflow") for a in argv[:2]):
            return pid
    raise AssertionError(f"no `airflow scheduler` under airflow standalone (pid {standalone_pid})")


def test_a_scheduler_killed_mid_batch_is_replaced_and_the_batch_commits_once(standalone, tmp_path):
    from microbatch.sinks import parquet as ps

    config = standalone.failover_config
    store = open_store(f"{config.root}/checkpoints", standalone.settings)
    layout = Layout()
    assert list_checkpoints(store, layout) == []  # a fresh pipeline: its first batch is 0
    now = utcnow().replace(microsecond=0)
    clicks = standalone.clicks_between(now - dt.timedelta(hours=2), now, count=60, seed=23)
    standalone.produce_clicks(clicks, topic=config.topic)
    standalone.airflow.unpause(FAILOVER_DAG_ID, standalone.token())
    run_id = standalone.trigger(FAILOVER_DAG_ID)["dag_run_id"]  # up to when it was queued

    # The batch is running and has stored its plan: kill the scheduler and all under it.
    plan = layout.plan_key(0)
    deadline = time.monotonic() + 300
    while not store.exists(plan):
        assert time.monotonic() < deadline, f"the batch of {run_id} stored no plan {plan}"
        time.sleep(0.5)
    scheduler = _scheduler_pid(standalone.airflow.process.pid())
    doomed = _descendants(scheduler)
    for pid in doomed:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    killed_at = time.monotonic()

    log = open(tmp_path / "scheduler-2.log", "wb")  # noqa: SIM115 (the process outlives the test)
    second = subprocess.Popen(
        [str(VENV_BIN / "airflow"), "scheduler"],
        env=standalone.env | {
            # A scheduler whose heartbeat is older than this is dead: its tasks are reset.
            "AIRFLOW__SCHEDULER__SCHEDULER_HEALTH_CHECK_THRESHOLD": "15",
            "AIRFLOW__SCHEDULER__ORPHANED_TASKS_CHECK_INTERVAL": "5",
        },
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    standalone.replacement_processes.append(second)

    final = standalone.wait_for_run(run_id, FAILOVER_DAG_ID, timeout=600)
    print(f"killed {len(doomed)} processes; the run succeeded "
          f"{time.monotonic() - killed_at:.0f} s later under the second scheduler")  # fmt: skip
    assert final["state"] == "success"
    batch = standalone.task_instances(run_id, FAILOVER_DAG_ID)["batch"]
    assert batch["try_number"] >= 2, batch  # the killed try, then the second scheduler's
    result = standalone.api(
        "GET",
        f"/api/v2/dags/{FAILOVER_DAG_ID}/dagRuns/{quote(run_id, safe='')}/taskInstances/batch/"
        "xcomEntries/return_value?deserialize=true",
    )["value"]
    assert result["status"] == "committed" and result["replayed"] is True
    assert result["records_in"] == len(clicks)
    assert list_checkpoints(store, layout) == [0]  # committed once

    everything = ps.read_parquet_sink(f"{config.root}/sessions", standalone.settings)
    seen = [(r["user_id"], r["session_start"]) for r in everything.to_pylist()]
    assert len(seen) == len(set(seen)), "a session is visible twice"
