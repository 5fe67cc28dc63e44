"""Kill-and-race: attempts that stall (SIGSTOP) and wake up after others went ahead, runs
killed with SIGKILL, two runs at once, a reshard after a crash between commit and publish.

Stalled attempts are real ``microbatch run`` processes that stop themselves at a named
point (``MICROBATCH_PAUSE_AT``); the runs that go ahead use the test's SparkSession. After
each scenario the Parquet output, read by following its commits, equals a plain-Python
count of the input, and no published file's bytes ever changed.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from microbatch.checkpoint import Layout, list_checkpoints
from microbatch.cli import main
from microbatch.errors import BatchError
from microbatch.runtime import BatchOptions, BatchRunner, Pipeline
from microbatch.runtime.fence import read_lease
from microbatch.sinks import parquet as ps
from microbatch.sinks import read_parquet_sink
from microbatch.storage import open_store
from tests.integration.runtime.pipelines import count_pipeline
from tests.integration.runtime.test_batches import clicks, new_topic, produce, totals

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[3]
#: Short, so a run taking over a stalled or killed one waits little: it must see the lease
#: expire and then watch it unchanged for one timeout (runtime/fence.py), so a takeover
#: after ``time.sleep(LEASE_S + 0.5)`` costs 2.5 s, as one after 2 s leases expired did.
LEASE_S = 1.0
JOB = """
import dataclasses
from tests.integration.runtime.pipelines import count_pipeline

pipeline = dataclasses.replace(
    count_pipeline({topic!r}, {root!r}), lease_timeout_s={lease}, retain_checkpoints={retain}
)
"""


@dataclasses.dataclass
class Setup:
    topic: str
    root: Path
    job: Path
    pipeline: Pipeline
    values: list[bytes]


@pytest.fixture
def setup(admin, bootstrap, tmp_path: Path) -> Setup:
    topic = new_topic(admin, 2)
    values = clicks(40)
    produce(bootstrap, topic, values)
    return make_setup(topic, tmp_path, values, retain=10)


def make_setup(
    topic: str, root: Path, values: list[bytes], retain: int, lease_s: float = LEASE_S
) -> Setup:
    job = root / "job.py"
    job.write_text(JOB.format(topic=topic, root=str(root), lease=lease_s, retain=retain))
    pipeline = dataclasses.replace(
        count_pipeline(topic, str(root)), lease_timeout_s=lease_s, retain_checkpoints=retain
    )
    return Setup(topic, root, job, pipeline, values)


def start_batch(settings, job: Path, run_id: str, pause_at: str) -> subprocess.Popen:
    """``microbatch run`` in its own process, stopping itself at ``pause_at``."""
    env = {**os.environ, **settings.to_env(), "MICROBATCH_PAUSE_AT": pause_at}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    env.setdefault("PYSPARK_PYTHON", sys.executable)
    return subprocess.Popen(
        [sys.executable, "-m", "microbatch.cli", "run", str(job), "--run-id", run_id, "--json"],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def wait_stopped(proc: subprocess.Popen, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"the batch process ended before pausing:\n{proc.stdout.read()}")
        state = Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        if state == "T":
            return
        time.sleep(0.1)
    proc.kill()
    raise AssertionError("the batch process did not pause")


def published(root: Path) -> dict[str, str]:
    """Every file the Parquet sinks' commits name, by key, with the hash of its bytes."""
    out = {}
    for sink in ("counts", "dead"):
        store = open_store(str(root / sink))
        for entry in ps.commit_entries(store).values():
            for key in entry["files"]:
                out[f"{sink}/{key}"] = hashlib.sha256(store.get(key)).hexdigest()
    return out


def counted(root: Path) -> dict[str, int]:
    table = read_parquet_sink(str(root / "counts"))
    per_user: collections.Counter[str] = collections.Counter()
    for row in table.to_pylist():
        per_user[row["user"]] += row["clicks"]
    return dict(per_user)


def test_a_zombie_that_planned_then_stalled_overwrites_nothing_its_retry_published(
    spark, kafka_settings, setup: Setup
) -> None:
    zombie = start_batch(kafka_settings, setup.job, "run-1", "after_plan")
    wait_stopped(zombie)

    retry = BatchRunner(spark, setup.pipeline, kafka_settings).run(BatchOptions(run_id="run-1"))
    assert retry.replayed and retry.records_in == len(setup.values)  # the zombie's plan
    before = published(setup.root)

    os.kill(zombie.pid, signal.SIGCONT)
    out, _ = zombie.communicate(timeout=300)

    assert zombie.returncode != 0 and "lost the lease" in out, out[-2000:]
    assert published(setup.root) == before  # same files, same bytes
    assert counted(setup.root) == totals(setup.values)
    assert list_checkpoints(open_store(setup.pipeline.checkpoints), Layout()) == [0]


def test_a_zombie_waking_after_retention_removed_its_checkpoint_cannot_commit_it_again(
    spark, kafka_settings, bootstrap, admin, tmp_path: Path
) -> None:
    topic = new_topic(admin, 2)
    setup = make_setup(topic, tmp_path, [], retain=2)
    zombie = start_batch(kafka_settings, setup.job, "zombie", "before_plan")
    wait_stopped(zombie)
    time.sleep(LEASE_S + 0.5)  # its lease expires: other runs go ahead

    values: list[bytes] = []
    for i in range(3):
        batch = clicks(15, seed=i + 1)
        produce(bootstrap, topic, batch)
        values += batch
        BatchRunner(spark, setup.pipeline, kafka_settings).run(BatchOptions(run_id=f"run-{i}"))
    store = open_store(setup.pipeline.checkpoints)
    assert list_checkpoints(store, Layout()) == [1, 2]  # checkpoint 0 is gone
    before = published(setup.root)

    os.kill(zombie.pid, signal.SIGCONT)  # it still thinks no batch ever ran
    out, _ = zombie.communicate(timeout=300)

    assert zombie.returncode != 0 and "lost the lease" in out, out[-2000:]
    assert list_checkpoints(store, Layout()) == [1, 2]
    assert published(setup.root) == before
    assert counted(setup.root) == totals(values)


def test_a_killed_run_blocks_others_only_until_its_lease_expires(
    spark, kafka_settings, admin, bootstrap, tmp_path: Path
) -> None:
    # A lease long enough that the refusal right after the kill is no race with its expiry.
    setup = make_setup(new_topic(admin, 2), tmp_path, clicks(40), retain=10, lease_s=2.0)
    produce(bootstrap, setup.topic, setup.values)
    killed = start_batch(kafka_settings, setup.job, "killed", "after_plan")
    wait_stopped(killed)
    killed.kill()  # SIGKILL: no release, no renewal
    killed.wait()

    with pytest.raises(BatchError, match="being run by 'killed'"):
        BatchRunner(spark, setup.pipeline, kafka_settings).run(BatchOptions(run_id="next"))
    lease = read_lease(open_store(setup.pipeline.checkpoints))
    assert lease is not None
    time.sleep(max(lease.expires_ms / 1000 - time.time(), 0) + 0.1)  # expired by our clock
    # The next run watches it unchanged for its timeout, then takes it over: no unlock.
    result = BatchRunner(spark, setup.pipeline, kafka_settings).run(BatchOptions(run_id="next"))

    assert result.replayed and result.records_in == len(setup.values)  # no unlock needed
    assert counted(setup.root) == totals(setup.values)


def test_two_runs_started_at_once_leave_one_batch(spark, kafka_settings, setup: Setup) -> None:
    barrier = threading.Barrier(2)
    outcomes: dict[str, object] = {}

    def run(run_id: str) -> None:
        barrier.wait()
        try:
            runner = BatchRunner(spark, setup.pipeline, kafka_settings)
            outcomes[run_id] = runner.run(BatchOptions(run_id=run_id))
        except BatchError as e:
            outcomes[run_id] = e

    threads = [threading.Thread(target=run, args=(r,)) for r in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()

    refused = [r for r, o in outcomes.items() if isinstance(o, BatchError)]
    assert len(refused) == 1, outcomes
    assert "being run by" in str(outcomes[refused[0]]) or "same time" in str(outcomes[refused[0]])
    assert list_checkpoints(open_store(setup.pipeline.checkpoints), Layout()) == [0]
    assert counted(setup.root) == totals(setup.values)


def test_a_reshard_after_a_crash_between_commit_and_publish_keeps_that_batchs_output(
    spark, kafka_settings, setup: Setup, monkeypatch, capsys
) -> None:
    with pytest.raises(Exception, match="injected crash"):
        BatchRunner(spark, setup.pipeline, kafka_settings).run(
            BatchOptions(run_id="r", crash_at="after_commit")
        )
    assert counted(setup.root) == {}  # committed, not published yet
    for name, value in kafka_settings.to_env().items():
        monkeypatch.setenv(name, value)
    monkeypatch.syspath_prepend(str(REPO))
    time.sleep(LEASE_S + 0.5)  # the crashed run's lease expires

    assert main(["reshard", str(setup.job), "--max-parallelism", "32", "--json"]) == 0

    assert json.loads(capsys.readouterr().out)["to_checkpoint"] == 1
    assert counted(setup.root) == totals(setup.values)


def test_an_s3_outage_mid_batch_fails_it_cleanly_and_the_rerun_commits_once(
    spark, kafka_settings, bootstrap, admin, tmp_path: Path
) -> None:
    """Checkpoints and sinks on an S3 server of its own that goes away while a batch is
    about to commit: the batch fails (its own error printed, the lease release's failure
    only logged), and once S3 is back its rerun commits the same records exactly once."""
    from microbatch.localstack.process import free_port_block
    from microbatch.localstack.seaweedfs import ALL_OFFSETS, SeaweedFS

    port = free_port_block(ALL_OFFSETS)
    s3 = dataclasses.replace(kafka_settings, s3_endpoint_url=f"http://127.0.0.1:{port}")
    server = SeaweedFS(s3, tmp_path / "seaweedfs")
    server.start()
    try:
        topic = new_topic(admin, 2)
        values = clicks(30)
        produce(bootstrap, topic, values)
        root = f"s3://{s3.s3_bucket}/outage"
        job = tmp_path / "job.py"
        job.write_text(JOB.format(topic=topic, root=root, lease=LEASE_S, retain=10))
        pipeline = dataclasses.replace(count_pipeline(topic, root), lease_timeout_s=LEASE_S)
        batch = start_batch(s3, job, "run-1", "before_commit")
        wait_stopped(batch)

        server.stop()
        os.kill(batch.pid, signal.SIGCONT)
        out, _ = batch.communicate(timeout=300)

        assert batch.returncode != 0
        assert "could not release the lease" in out  # logged, not raised over the error
        errors = [line for line in out.splitlines() if line.startswith("microbatch run: ")]
        assert errors and "S3" in errors[-1], out[-2000:]
        server.start()
        rerun = BatchRunner(spark, pipeline, s3).run(BatchOptions(run_id="run-1"))

        assert rerun.replayed and rerun.records_in == len(values)
        per_user: collections.Counter[str] = collections.Counter()
        for row in read_parquet_sink(f"{root}/counts", s3).to_pylist():
            per_user[row["user"]] += row["clicks"]
        assert dict(per_user) == totals(values)
    finally:
        server.stop()
