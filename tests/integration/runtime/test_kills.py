"""Kill-and-race inside the steps that have no ``crash_at`` of their own: a Kafka sink's
open transaction, a broker restart, a rewind's publish, a reshard, GC.

A real ``microbatch`` process stops itself at a named point (``MICROBATCH_PAUSE_AT``) and
is then SIGKILLed there (a crash) or resumed after others went ahead (a zombie). After each
scenario, independent readers equal a plain-Python count of the input: a ``read_committed``
consumer of the output topic, the Parquet sink read by following its commits, and the
state of every key.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from microbatch.checkpoint import Layout, latest_manifest, list_checkpoints, load_manifest
from microbatch.checkpoint.inspection import read_key_state
from microbatch.checkpoint.restore import restore_instance
from microbatch.cli import main
from microbatch.localstack.topics import read_topic
from microbatch.runtime import BatchOptions, BatchRunner, Pipeline
from microbatch.settings import Settings
from microbatch.sinks import last_published
from microbatch.storage import open_store
from tests.integration.runtime.pipelines import count_pipeline
from tests.integration.runtime.test_batches import clicks, new_topic, produce, totals
from tests.integration.runtime.test_zombies import (
    LEASE_S,
    REPO,
    counted,
    make_setup,
    published,
    wait_stopped,
)

pytestmark = pytest.mark.integration

KAFKA_FIRST_JOB = """
import dataclasses
from tests.integration.runtime.pipelines import count_pipeline

pipeline = dataclasses.replace(
    count_pipeline({topic!r}, {root!r}, out_topic={out!r}, kafka_first=True),
    lease_timeout_s={lease},
)
"""


def start_cli(
    settings: Settings, args: list[str], pause_at: str, log: Path | None = None
) -> subprocess.Popen:
    """``microbatch <args>`` in its own process, stopping itself at ``pause_at``; its
    output in ``log`` when given (readable while it runs), else in a pipe."""
    env = {**os.environ, **settings.to_env(), "MICROBATCH_PAUSE_AT": pause_at}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    env.setdefault("PYSPARK_PYTHON", sys.executable)
    with open(log, "w") if log is not None else contextlib.nullcontext() as out:
        return subprocess.Popen(
            [sys.executable, "-m", "microbatch.cli", *args, "--json"],
            cwd=REPO,
            env=env,
            stdout=out or subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )


def wait_for_output(proc: subprocess.Popen, log: Path, text: str, timeout_s: float = 60) -> None:
    """Wait until ``text`` is in the running process's ``log``."""
    deadline = time.monotonic() + timeout_s
    while text not in log.read_text():
        ended = proc.poll() is not None
        assert not ended and time.monotonic() < deadline, (
            f"no {text!r} in {log} ({'ended' if ended else 'still running'}):\n"
            f"{log.read_text()[-2000:]}"
        )
        time.sleep(0.1)


def kill(proc: subprocess.Popen) -> None:
    """SIGKILL: no clean-up, no lease release, exactly a crash."""
    proc.kill()
    proc.wait()
    time.sleep(LEASE_S + 0.5)  # its lease expires; the next run needs no unlock


def kafka_first(topic: str, out: str, root: Path) -> tuple[Path, Pipeline]:
    job = root / "job.py"
    job.write_text(KAFKA_FIRST_JOB.format(topic=topic, root=str(root), out=out, lease=LEASE_S))
    pipeline = dataclasses.replace(
        count_pipeline(topic, str(root), out_topic=out, kafka_first=True), lease_timeout_s=LEASE_S
    )
    return job, pipeline


def topic_totals(bootstrap: str, topic: str) -> tuple[dict[str, int], int]:
    """Clicks per user as a ``read_committed`` consumer of ``topic`` sees them, and the
    number of messages."""
    per_user: collections.Counter[str] = collections.Counter()
    messages = read_topic(bootstrap, topic)
    for m in messages:
        row = json.loads(m.value)
        per_user[row["user"]] += row["clicks"]
    return dict(per_user), len(messages)


def parquet_rows(root: Path) -> int:
    from microbatch.sinks import read_parquet_sink

    return read_parquet_sink(str(root / "counts")).num_rows


def state_totals(root: Path, users: list[str]) -> dict[str, int]:
    """Each user's running total, read from the newest checkpoint key by key."""
    store = open_store(str(root / "checkpoints"))
    return {u: read_key_state(store, Layout(), u)["total"] for u in users}


def test_a_run_killed_inside_its_kafka_transaction_publishes_once_when_rerun(
    spark, kafka_settings, bootstrap, admin, tmp_path: Path
) -> None:
    topic, out = new_topic(admin, 2), new_topic(admin, 1)
    values = clicks(40)
    produce(bootstrap, topic, values)
    job, pipeline = kafka_first(topic, out, tmp_path)
    crashed = start_cli(kafka_settings, ["run", str(job), "--run-id", "r"], "in_kafka_transaction")
    wait_stopped(crashed)  # every message sent, the transaction open
    kill(crashed)
    assert counted(tmp_path) == {}  # the Parquet sink publishes after Kafka

    BatchRunner(spark, pipeline, kafka_settings).run(BatchOptions(run_id="r"))

    per_user, messages = topic_totals(bootstrap, out)
    assert per_user == totals(values)  # the open transaction was aborted, not committed
    assert messages == parquet_rows(tmp_path) == len(totals(values))
    assert counted(tmp_path) == totals(values)
    assert last_published(bootstrap, "counts", "counts_topic", out) == 0


def test_a_zombie_waking_inside_its_kafka_transaction_is_fenced_by_the_broker(
    spark, kafka_settings, bootstrap, admin, tmp_path: Path
) -> None:
    topic, out = new_topic(admin, 2), new_topic(admin, 1)
    values = clicks(40, seed=4)
    produce(bootstrap, topic, values)
    job, pipeline = kafka_first(topic, out, tmp_path)
    zombie = start_cli(kafka_settings, ["run", str(job), "--run-id", "r"], "in_kafka_transaction")
    wait_stopped(zombie)
    time.sleep(LEASE_S + 0.5)  # its lease expires: the retry goes ahead and publishes

    BatchRunner(spark, pipeline, kafka_settings).run(BatchOptions(run_id="r"))
    before = published(tmp_path)
    os.kill(zombie.pid, signal.SIGCONT)  # it goes on to commit its transaction
    output, _ = zombie.communicate(timeout=300)

    assert zombie.returncode != 0 and "transaction was fenced" in output, output[-2000:]
    per_user, messages = topic_totals(bootstrap, out)
    assert per_user == totals(values) and messages == len(totals(values))
    assert published(tmp_path) == before
    assert counted(tmp_path) == totals(values)


def test_a_broker_restart_while_a_batch_runs_loses_and_doubles_nothing(
    spark, kafka_settings, tmp_path: Path
) -> None:
    """A broker of its own, restarted while a batch is paused after planning (the batch
    then reads from the restarted broker), and down while the next batch publishes (the
    publish retries, or fails and its rerun publishes once)."""
    from kafka.admin import KafkaAdminClient

    from microbatch.localstack import KafkaBroker
    from microbatch.localstack.process import free_port_block

    port = free_port_block([0, 1])
    settings = dataclasses.replace(kafka_settings, kafka_bootstrap_servers=f"127.0.0.1:{port}")
    broker = KafkaBroker(settings, tmp_path / "kafka")
    broker.start()
    try:
        admin = KafkaAdminClient(bootstrap_servers=settings.kafka_bootstrap_servers)
        topic, out = new_topic(admin, 2), new_topic(admin, 1)
        admin.close()
        job, pipeline = kafka_first(topic, out, tmp_path)
        values = clicks(40, seed=5)
        produce(settings.kafka_bootstrap_servers, topic, values)

        first = start_cli(settings, ["run", str(job), "--run-id", "a"], "after_plan")
        wait_stopped(first)
        broker.stop()
        broker.start()
        os.kill(first.pid, signal.SIGCONT)
        output, _ = first.communicate(timeout=300)
        assert first.returncode == 0, output[-2000:]

        more = clicks(30, seed=6)
        produce(settings.kafka_bootstrap_servers, topic, more)
        values += more
        log = tmp_path / "second.log"
        second = start_cli(settings, ["run", str(job), "--run-id", "b"], "before_publish", log)
        wait_stopped(second)
        broker.stop()
        os.kill(second.pid, signal.SIGCONT)
        wait_for_output(second, log, "ECONNREFUSED")  # it publishes to the stopped broker
        broker.start()
        second.wait(timeout=300)
        output = log.read_text()
        if second.returncode != 0:  # the publish gave up while the broker was down
            assert "rerun" in output, output[-2000:]
            time.sleep(LEASE_S + 0.5)
            BatchRunner(spark, pipeline, settings).run(BatchOptions(run_id="b"))

        per_user, messages = topic_totals(settings.kafka_bootstrap_servers, out)
        assert per_user == totals(values)
        assert messages == parquet_rows(tmp_path)  # one message per output row, no repeat
        assert counted(tmp_path) == totals(values)
        assert state_totals(tmp_path, sorted(per_user)) == totals(values)
    finally:
        broker.stop()


def test_a_kill_inside_gc_leaves_every_retained_checkpoint_whole_and_the_next_gc_finishes(
    spark, kafka_settings, bootstrap, admin, tmp_path: Path
) -> None:
    topic = new_topic(admin, 2)
    setup = make_setup(topic, tmp_path, [], retain=2)
    values: list[bytes] = []

    def more(seed: int) -> None:
        batch = clicks(15, seed=seed)
        produce(bootstrap, topic, batch)
        values.extend(batch)

    for i in range(3):
        more(i + 1)
        BatchRunner(spark, setup.pipeline, kafka_settings).run(BatchOptions(run_id=f"run-{i}"))
    more(10)
    crashed = start_cli(kafka_settings, ["run", str(setup.job), "--run-id", "gc"], "during_gc")
    wait_stopped(crashed)  # batch 3 published, manifest 1 deleted, its files not yet
    kill(crashed)
    store, layout = open_store(setup.pipeline.checkpoints), Layout()
    assert list_checkpoints(store, layout) == [2, 3]
    leftover = [k for k in store.list(layout.state) if layout.state_id(k) == 1]
    assert leftover, "GC was killed before deleting checkpoint 1's state files"

    for m in (load_manifest(store, layout, 2), load_manifest(store, layout, 3)):
        for i in range(m.parallelism):
            restore_instance(store, m, m.parallelism, i)  # nothing a retained one needs is gone
    more(11)
    BatchRunner(spark, setup.pipeline, kafka_settings).run(BatchOptions(run_id="after"))

    retained = [load_manifest(store, layout, c) for c in list_checkpoints(store, layout)]
    referenced = set().union(*(m.files() for m in retained))
    assert set(store.list(layout.state)) == referenced  # the killed GC's leftovers went
    assert counted(setup.root) == totals(values)
    assert state_totals(setup.root, sorted(totals(values))) == totals(values)


def test_a_rewind_killed_between_its_commit_and_its_publish_is_published_by_the_next_run(
    spark, kafka_settings, bootstrap, admin, tmp_path: Path
) -> None:
    topic = new_topic(admin, 2)
    setup = make_setup(topic, tmp_path, [], retain=10)
    values: list[bytes] = []
    for i in range(2):
        batch = clicks(20, seed=20 + i)
        produce(bootstrap, topic, batch)
        values += batch
        BatchRunner(spark, setup.pipeline, kafka_settings).run(BatchOptions(run_id=f"run-{i}"))
    replay = ["replay", str(setup.job), "--from-checkpoint", "0", "--run-id", "replay"]
    crashed = start_cli(kafka_settings, replay, "after_rewind_commit")
    wait_stopped(crashed)
    kill(crashed)
    store = open_store(setup.pipeline.checkpoints)
    assert latest_manifest(store, Layout()).checkpoint_id == 2  # the rewind's copy, committed
    assert counted(setup.root) == totals(values)  # batch 1's output stays until replaced

    result = BatchRunner(spark, setup.pipeline, kafka_settings).run(BatchOptions(run_id="next"))

    assert result.records_in == 20  # batch 1's records, read again
    assert counted(setup.root) == totals(values)  # replaced, not doubled
    assert state_totals(setup.root, sorted(totals(values))) == totals(values)


def test_a_reshard_killed_before_its_commit_can_be_run_again(
    spark, kafka_settings, bootstrap, admin, tmp_path: Path, monkeypatch, capsys
) -> None:
    topic = new_topic(admin, 2)
    values = clicks(40, seed=30)
    produce(bootstrap, topic, values)
    setup = make_setup(topic, tmp_path, values, retain=10)
    BatchRunner(spark, setup.pipeline, kafka_settings).run(BatchOptions(run_id="run-0"))
    reshard = ["reshard", str(setup.job), "--max-parallelism", "32"]
    crashed = start_cli(kafka_settings, reshard, "during_reshard")
    wait_stopped(crashed)  # its state files written, its manifest not
    kill(crashed)
    store = open_store(setup.pipeline.checkpoints)
    assert list_checkpoints(store, Layout()) == [0]
    for name, value in kafka_settings.to_env().items():
        monkeypatch.setenv(name, value)
    monkeypatch.syspath_prepend(str(REPO))

    assert main([*reshard, "--json"]) == 0

    assert json.loads(capsys.readouterr().out)["to_checkpoint"] == 1
    assert latest_manifest(store, Layout()).max_parallelism == 32
    assert state_totals(tmp_path, sorted(totals(values))) == totals(values)
    assert counted(tmp_path) == totals(values)
