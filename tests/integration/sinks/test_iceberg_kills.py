"""The Iceberg sink killed at each point of its publish, and a zombie publish, on a real
pipeline: Kafka, Spark, a SQLite catalog and a local warehouse read back with pyiceberg.

A batch is committed, then a real ``microbatch run`` process stops itself inside the
Iceberg publish (``MICROBATCH_PAUSE_AT``) and is SIGKILLed there. The killed runs publish
in their recovery step (the batch was committed, by the test's process, with
``crash_at="after_commit"``), so they need no Spark of their own: the publish is the same
code whichever run does it. The zombie runs its batch from the start, and stops where it
would commit the snapshot; the run that took its lease over publishes, then the zombie
resumes. After each, the table's rows equal a plain-Python count of the input, each
batch's rows once, in one snapshot per batch.

Also here, two bugs the kill tests ran into: a first batch's stage-2 tasks racing to
create the table, and a job process that never exited once pyiceberg's pool had run.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import json
import os
import signal
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from microbatch.checkpoint import Layout
from microbatch.errors import MicrobatchError
from microbatch.runtime import BatchOptions, BatchRunner, Pipeline
from microbatch.runtime.publish import is_published
from microbatch.settings import Settings
from microbatch.sinks import IcebergCatalog, IcebergSink
from microbatch.sinks.iceberg import read_iceberg_sink
from microbatch.storage import open_store
from tests.integration.runtime.pipelines import COUNT_SCHEMA, count_pipeline
from tests.integration.runtime.test_batches import clicks, new_topic, produce
from tests.integration.runtime.test_kills import kill
from tests.integration.runtime.test_zombies import LEASE_S, start_batch, wait_stopped

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("pyiceberg_threads")]

JOB = """
import dataclasses
from tests.integration.runtime.pipelines import count_pipeline

pipeline = dataclasses.replace(
    count_pipeline({topic!r}, {root!r}, iceberg={iceberg!r}), lease_timeout_s={lease}
)
"""
SINK = "counts_iceberg"


@dataclasses.dataclass
class Lake:
    """A pipeline counting clicks into Parquet and an Iceberg table, and its job file."""

    topic: str
    job: Path
    pipeline: Pipeline
    batches: list[list[bytes]] = dataclasses.field(default_factory=list)

    def add(self, bootstrap: str, values: list[bytes]) -> None:
        """Clicks for the next batch."""
        produce(bootstrap, self.topic, values)
        self.batches.append(values)

    def run(self, spark, settings, run_id: str, **options: Any) -> Any:
        return BatchRunner(spark, self.pipeline, settings).run(
            BatchOptions(run_id=run_id, **options)
        )

    def table(self) -> Any:
        return self.pipeline.sink(SINK).target(None, self.pipeline.name).load()


@pytest.fixture
def lake(admin, tmp_path: Path) -> Lake:
    topic = new_topic(admin, 2)
    iceberg = str(tmp_path / "iceberg")
    job = tmp_path / "job.py"
    job.write_text(JOB.format(topic=topic, root=str(tmp_path), iceberg=iceberg, lease=LEASE_S))
    pipeline = dataclasses.replace(
        count_pipeline(topic, str(tmp_path), iceberg=iceberg), lease_timeout_s=LEASE_S
    )
    return Lake(topic, job, pipeline)


def reference(batches: list[list[bytes]]) -> list[tuple[str, int, int]]:
    """(user, clicks, total) rows a clean run emits: one per user per batch it clicked in,
    with the running total."""
    total: collections.Counter[str] = collections.Counter()
    rows = []
    for values in batches:
        clicked = collections.Counter(json.loads(v)["user"] for v in values)
        total.update(clicked)
        rows += [(user, n, total[user]) for user, n in clicked.items()]
    return sorted(rows)


def rows(lake: Lake) -> list[tuple[str, int, int]]:
    table = read_iceberg_sink(lake.pipeline.sink(SINK))
    return sorted((r["user"], r["clicks"], r["total"]) for r in table.to_pylist())


def snapshots(lake: Lake) -> list[tuple[str, str | None]]:
    """(operation, batch) of every snapshot, oldest first."""
    table = lake.table()
    return [
        (s.summary.operation.value, s.summary.additional_properties.get("microbatch.batch"))
        for s in sorted(table.snapshots(), key=lambda s: s.sequence_number)
    ]


def published(lake: Lake, batch_id: int) -> bool:
    return is_published(open_store(lake.pipeline.checkpoints), Layout(), batch_id)


@pytest.mark.parametrize(
    "point", ["in_iceberg_commit", "after_iceberg_commit", "in_iceberg_overwrite"]
)
def test_a_run_killed_at_each_point_of_its_iceberg_publish_leaves_each_row_once_after_a_rerun(
    spark, kafka_settings, bootstrap, lake: Lake, point: str
) -> None:
    lake.add(bootstrap, clicks(20, seed=1))
    lake.run(spark, kafka_settings, "run-0")
    lake.add(bootstrap, clicks(15, seed=2))
    if point == "in_iceberg_overwrite":  # batch 1 published, undone, then read again
        lake.run(spark, kafka_settings, "run-1")
        BatchRunner(spark, lake.pipeline, kafka_settings).replay_from(0, run_id="replay")
    before = rows(lake)
    with pytest.raises(MicrobatchError, match="injected crash"):
        lake.run(spark, kafka_settings, "crashed", crash_at="after_commit")
    batch = 3 if point == "in_iceberg_overwrite" else 1
    assert not published(lake, batch)

    # Retries of the crashed run (its run id): each takes the lease over at once, however
    # recently the run before it renewed the lease (another id must see it expire first).
    killed = start_batch(kafka_settings, lake.job, "crashed", point)
    wait_stopped(killed)  # its recovery step publishing the committed batch
    kill(killed)

    if point == "after_iceberg_commit":  # the snapshot is in; the batch is not marked
        assert rows(lake) == reference(lake.batches) and not published(lake, batch)
    else:  # nothing of the batch is visible: batch 1's old rows stay until replaced
        assert rows(lake) == before
    result = lake.run(spark, kafka_settings, "crashed")

    assert result.recovered_publish == batch and result.records_in == 0
    assert rows(lake) == reference(lake.batches)
    if point == "in_iceberg_overwrite":
        assert snapshots(lake) == [
            ("append", "0"),
            ("append", "1"),
            ("append", "2"),  # the rewind: no data change
            ("overwrite", "3"),  # batch 1's files out, batch 3's in
        ]
        target = lake.pipeline.sink(SINK).target(None, lake.pipeline.name)
        assert sorted(target.visible_batches(lake.table())) == [0, 3]
    else:
        assert snapshots(lake) == [("append", "0"), ("append", "1")]


def test_a_zombie_stopped_before_its_iceberg_commit_commits_nothing_after_the_lease_moved(
    spark, kafka_settings, bootstrap, lake: Lake
) -> None:
    lake.add(bootstrap, clicks(20, seed=3))
    zombie = start_batch(kafka_settings, lake.job, "zombie", "in_iceberg_commit")
    wait_stopped(zombie)  # batch 0 committed, its snapshot written, the catalog not swapped
    assert rows(lake) == []

    took_over = lake.run(spark, kafka_settings, "zombie")  # a retry: the lease moves at once
    lake.add(bootstrap, clicks(15, seed=4))
    after = lake.run(spark, kafka_settings, "after")  # batch 2: the retry's was idle
    os.kill(zombie.pid, signal.SIGCONT)
    out, _ = zombie.communicate(timeout=120)

    assert took_over.recovered_publish == 0
    assert zombie.returncode != 0 and "lost the lease" in out, out[-2000:]
    assert "(found before GC)" in out, out[-2000:]  # its publish ran through, no error
    assert rows(lake) == reference(lake.batches)
    assert snapshots(lake) == [("append", "0"), ("append", str(after.batch_id))]


def test_the_first_batchs_tasks_racing_to_create_the_table_all_get_the_one_table(
    test_settings: Settings, tmp_path: Path
) -> None:
    # The SQL catalog checks for the namespace, then inserts it: a racing loser got the
    # database's unique-key error (in ~2 of 3 rounds of 8 before the sink took it as made).
    for round_ in range(8):
        root = tmp_path / str(round_)
        catalog = IcebergCatalog.sql(f"sqlite:///{root}/catalog.db", (root / "wh").as_uri())
        sink = IcebergSink("counts", "lake.counts", COUNT_SCHEMA, catalog=catalog)
        tasks = [sink.target(test_settings, "counts") for _ in range(8)]
        tasks[0].open_catalog()  # the catalog's own tables exist, as after any first use
        start = threading.Barrier(len(tasks))
        with ThreadPoolExecutor(len(tasks)) as pool:
            tables = pool.map(functools.partial(_created, start=start), tasks)
            assert len({t.metadata.table_uuid for t in tables}) == 1


def _created(task: Any, start: threading.Barrier) -> Any:
    start.wait()
    return task.ready_table()


def test_a_job_process_exits_after_pyiceberg_used_its_thread_pool() -> None:
    # The job processes' exit (cli.exit_now) joined every non-daemon thread before running
    # threading's exit hooks: pyiceberg's pool workers, idle after a publish, waited forever.
    script = (
        "from pyiceberg.utils.concurrent import ExecutorFactory\n"
        "from microbatch.cli import exit_now\n"
        "ExecutorFactory.get_or_create().submit(int).result()\n"
        "exit_now(3)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], timeout=30, capture_output=True)
    assert done.returncode == 3, done.stderr
