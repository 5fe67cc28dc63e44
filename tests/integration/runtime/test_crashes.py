"""Crash at every point of the commit protocol, rerun, and compare with a clean run.

Identical Parquet rows, identical ``read_committed`` Kafka output, identical PostgreSQL
tables (upserted totals, appended rows), identical dead letters and identical state — also
when the rerun asks for another parallelism.
"""

from __future__ import annotations

import collections
import hashlib
import json
from pathlib import Path
from typing import Any

import psycopg
import pytest

from microbatch.checkpoint import Layout, latest_manifest
from microbatch.checkpoint.restore import restore_instance
from microbatch.localstack.topics import read_topic
from microbatch.runtime import CRASH_POINTS, BatchOptions, BatchRunner
from microbatch.sinks import last_published, read_parquet_sink
from microbatch.storage import open_store
from tests.integration.runtime.pipelines import click, count_pipeline
from tests.integration.runtime.test_batches import clicks, new_topic, produce

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def source_topic(bootstrap, admin) -> str:
    topic = new_topic(admin, 3)
    produce(bootstrap, topic, [*clicks(90, seed=3), b"oops", click("z", "/", bad=1)[:-1]])
    return topic


def all_state(root: Path) -> dict[bytes, Any]:
    store = open_store(str(root / "checkpoints"))
    manifest = latest_manifest(store, Layout())
    backend, _ = restore_instance(store, manifest, 1, 0)
    return {kg: backend.export_rows(kg) for kg in range(manifest.max_parallelism)}


def pg_tables(dsn: str, root: Path) -> tuple[str, str]:
    """(dsn, table prefix) of a run's PostgreSQL sinks: a prefix per run folder."""
    return dsn, "counts_" + hashlib.sha256(str(root).encode()).hexdigest()[:10]


def outcome(root: Path, bootstrap: str, out_topic: str, dsn: str) -> dict[str, Any]:
    def rows(name: str) -> list[dict]:
        return sorted(
            read_parquet_sink(str(root / name)).to_pylist(),
            key=lambda r: tuple(str(v) for v in r.values()),
        )

    _, prefix = pg_tables(dsn, root)
    with psycopg.connect(dsn) as conn:
        totals = conn.execute(f'SELECT "user", total FROM {prefix}_totals ORDER BY 1')
        log = conn.execute(f'SELECT "user", clicks, total FROM {prefix}_log ORDER BY 1, 3')
        pg = {"totals": dict(totals.fetchall()), "log": log.fetchall()}
    return {
        "pg": pg,
        "counts": rows("counts"),
        "dead": rows("dead"),
        "kafka": sorted(((m.key, m.value) for m in read_topic(bootstrap, out_topic)), key=str),
        "state": all_state(root),
    }


def run_three(
    spark, settings, topic, root: Path, out_topic: str, dsn: str, crash_at: str | None
) -> None:
    """Batch 0 at P=2, batch 1 at P=2 (crashing if asked, then rerun asking P=3), batch 2."""
    pipe = count_pipeline(
        topic,
        str(root),
        out_topic=out_topic,
        max_records_per_batch=50,
        parallelism=2,
        postgres=pg_tables(dsn, root),
    )
    BatchRunner(spark, pipe, settings).run(BatchOptions(run_id="r0"))
    if crash_at is not None:
        with pytest.raises(Exception, match="injected crash"):
            BatchRunner(spark, pipe, settings).run(BatchOptions(run_id="r1", crash_at=crash_at))
        BatchRunner(spark, pipe, settings).run(BatchOptions(run_id="r1", parallelism=3))
    else:
        BatchRunner(spark, pipe, settings).run(BatchOptions(run_id="r1"))
    BatchRunner(spark, pipe, settings).run(BatchOptions(run_id="r2", parallelism=3))


@pytest.fixture(scope="module")
def clean(spark, kafka_settings, bootstrap, admin, source_topic, postgres_dsn, tmp_path_factory):
    root = tmp_path_factory.mktemp("clean")
    out_topic = new_topic(admin, 2)
    run_three(spark, kafka_settings, source_topic, root, out_topic, postgres_dsn, None)
    return outcome(root, bootstrap, out_topic, postgres_dsn)


def test_clean_run_is_complete(clean) -> None:
    assert sum(r["clicks"] for r in clean["counts"]) == 90
    by_user = collections.Counter()
    for r in clean["counts"]:
        by_user[r["user"]] += r["clicks"]
    assert clean["pg"]["totals"] == dict(by_user)  # the last total per user: its count
    appended = sorted((r["user"], r["clicks"], r["total"]) for r in clean["counts"])
    assert sorted(clean["pg"]["log"]) == appended  # every row once


@pytest.mark.parametrize("crash_at", CRASH_POINTS)
def test_crash_then_rerun_equals_the_clean_run(
    crash_at, clean, spark, kafka_settings, bootstrap, admin, source_topic, postgres_dsn, tmp_path
) -> None:
    out_topic = new_topic(admin, 2)
    run_three(spark, kafka_settings, source_topic, tmp_path, out_topic, postgres_dsn, crash_at)
    got = outcome(tmp_path, bootstrap, out_topic, postgres_dsn)
    assert got["pg"] == clean["pg"]
    assert got["counts"] == clean["counts"]
    assert got["kafka"] == clean["kafka"]
    assert got["dead"] == clean["dead"]
    assert got["state"] == clean["state"]


def test_an_empty_batch_opens_no_transaction_and_the_next_batch_still_publishes_once(
    spark, kafka_settings, bootstrap, admin, tmp_path
) -> None:
    """Empty batches skip the Kafka transaction, so the publish marker keeps naming the last
    batch with messages; a crash while publishing the next one must still not double it."""
    topic, out_topic = new_topic(admin, 2), new_topic(admin, 1)
    pipe = count_pipeline(topic, str(tmp_path), out_topic=out_topic)
    produce(bootstrap, topic, clicks(20))
    BatchRunner(spark, pipe, kafka_settings).run(BatchOptions(run_id="full"))
    empty = BatchRunner(spark, pipe, kafka_settings).run(BatchOptions(run_id="empty"))
    assert empty.records_in == 0
    assert last_published(bootstrap, "counts", "counts_topic", out_topic) == 0

    produce(bootstrap, topic, clicks(10, seed=1))
    with pytest.raises(Exception, match="injected crash"):
        BatchRunner(spark, pipe, kafka_settings).run(
            BatchOptions(run_id="next", crash_at="during_publish")
        )
    BatchRunner(spark, pipe, kafka_settings).run(BatchOptions(run_id="next"))
    assert last_published(bootstrap, "counts", "counts_topic", out_topic) == 2

    def by_content(rows: list[dict]) -> list[dict]:
        return sorted(rows, key=lambda r: json.dumps(r, sort_keys=True))

    published = by_content([json.loads(m.value) for m in read_topic(bootstrap, out_topic)])
    expected = by_content(read_parquet_sink(str(tmp_path / "counts")).to_pylist())
    assert published == expected, "read_committed output != the Parquet rows"
    assert sum(r["clicks"] for r in published) == 30
