"""The issue's payments job — enrichment, hopping windows per card, alerts with timers, a
branch per merchant — as one dataflow: its outputs equal a plain-Python reference batch
by batch, and stay equal across rescales, a crash at every point followed by a rerun, and
a backfill."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest

from microbatch.runtime import CRASH_POINTS, BatchOptions, BatchRunner
from microbatch.sinks import parquet as ps
from microbatch.sinks import read_parquet_sink
from microbatch.storage import open_store
from tests.integration.dataflow.plans import one_batch_plan
from tests.integration.dataflow.risky_payments import payment, reference, risky_payments
from tests.integration.runtime.test_batches import new_topic, produce

pytestmark = pytest.mark.integration

VALUES = [payment(i) for i in range(150)] + [b"not json"]
PER_BATCH = 51  # three batches


@pytest.fixture(scope="module")
def topic(bootstrap, admin) -> dict[str, Any]:
    """The topic, and the watermark once all of it is read: the least, over partitions,
    of the largest event time each holds (Flink's rule; nothing idles)."""
    name = new_topic(admin, 3)
    placed = produce(bootstrap, name, VALUES)
    return {"name": name, "watermark": watermark_of(range(150), placed), "placed": placed}


def watermark_of(read: Iterable[int], placed: list[tuple[int, int]]) -> int:
    """The least, over partitions, of the largest event time of the payments ``read``
    (their indices) that reach a keyed step: refunds are filtered out before (payment
    ``i`` is at ``1000 * i``; the last value, not JSON, has none)."""
    latest: dict[int, int] = {}
    for i in read:
        part = placed[i][0]
        if i < 150 and json.loads(VALUES[i])["amount"] > 0:
            latest[part] = max(latest.get(part, 0), 1_000 * i)
    return min(latest.values())


def rows(root: Path, sink: str) -> list[dict[str, Any]]:
    return read_parquet_sink(str(root / sink)).to_pylist()


def outcome(root: Path) -> dict[str, Any]:
    merchants: dict[str, dict[str, int]] = {}
    for r in rows(root, "merchants"):  # each batch's running totals: keep the largest
        if r["count"] > merchants.get(r["merchant"], {"count": -1})["count"]:
            merchants[r["merchant"]] = {k: r[k] for k in ("count", "sum", "risky")}
    return {
        "windows": sorted(rows(root, "windows"), key=lambda w: (w["key"], w["window_start"])),
        "alerts": sorted(rows(root, "alerts"), key=lambda a: (a["card"], a["window_end"])),
        "quiet": sorted(rows(root, "quiet"), key=lambda q: (q["card"], q["quiet_until"])),
        "merchants": dict(sorted(merchants.items())),
    }


def run(spark, settings, topic: str, root: Path, parallelisms: list[int]) -> None:
    pipe = risky_payments(topic, str(root), max_records=-(-len(VALUES) // len(parallelisms)))
    for i, p in enumerate(parallelisms):
        BatchRunner(spark, pipe, settings).run(BatchOptions(run_id=f"r{i}", parallelism=p))


@pytest.fixture(scope="module")
def clean(spark, kafka_settings, topic, tmp_path_factory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("risky-clean")
    run(spark, kafka_settings, topic["name"], root, [2, 2, 2])
    return {"root": root, "outcome": outcome(root)}


def test_one_dataflow_gives_the_reference_outputs(clean, topic) -> None:
    want = reference(VALUES, topic["watermark"])
    assert want["alerts"] and want["quiet"], "the data must raise alerts and end quiet periods"
    got = clean["outcome"]
    assert got["windows"] == want["windows"]
    assert got["alerts"] == want["alerts"]
    assert got["quiet"] == want["quiet"]
    assert got["merchants"] == want["merchants"]
    assert [d["reason"] for d in rows(clean["root"], "dead")] == ["undecodable"]


def test_rescaling_2_3_1_4_between_batches_changes_no_output(
    clean, spark, kafka_settings, topic, tmp_path
) -> None:
    run(spark, kafka_settings, topic["name"], tmp_path, [2, 3, 1, 4])
    assert outcome(tmp_path) == clean["outcome"]


def test_each_batch_s_outputs_equal_the_reference_of_what_it_read(
    spark, kafka_settings, topic, tmp_path
) -> None:
    """After each batch (rescaled 2→3→1→4), the outputs so far are the reference's over
    the values the batches read, at the watermark they reached."""
    pipe = risky_payments(topic["name"], str(tmp_path), max_records=-(-len(VALUES) // 4))
    read: set[tuple[int, int]] = set()
    for i, p in enumerate([2, 3, 1, 4]):
        result = BatchRunner(spark, pipe, kafka_settings).run(
            BatchOptions(run_id=f"r{i}", parallelism=p)
        )
        read |= {(r["partition"], o) for r in result.ranges for o in range(r["from"], r["until"])}
        values = [n for n, at in enumerate(topic["placed"]) if at in read]
        watermark = watermark_of(values, topic["placed"])
        assert result.watermark == watermark, f"batch {i}"
        want = reference([VALUES[n] for n in values], watermark)
        assert outcome(tmp_path) == want, f"batch {i} (read {len(values)} values)"
    assert len(read) == len(VALUES)


@pytest.mark.parametrize("crash_at", CRASH_POINTS)
def test_a_crash_then_a_rerun_equals_the_clean_run(
    crash_at, clean, spark, kafka_settings, topic, tmp_path
) -> None:
    pipe = risky_payments(topic["name"], str(tmp_path), max_records=PER_BATCH)
    BatchRunner(spark, pipe, kafka_settings).run(BatchOptions(run_id="r0"))
    with pytest.raises(Exception, match="injected crash"):
        BatchRunner(spark, pipe, kafka_settings).run(BatchOptions(run_id="r1", crash_at=crash_at))
    for i in (1, 2, 3):  # after_commit: the crashed attempt committed batch 1; one is empty
        BatchRunner(spark, pipe, kafka_settings).run(BatchOptions(run_id=f"r{i}", parallelism=3))
    assert outcome(tmp_path) == clean["outcome"]


def test_the_branches_off_the_source_share_one_exchange(spark, kafka_settings, topic, tmp_path):
    """Three keyed steps in one level — the windows per card and the merchants (both
    read the source), and the alerts, which read the windows on the windows' own key
    (chained: their records handed over in the task) — so the batch's one query has
    one exchange."""
    pipe = risky_payments(topic["name"], str(tmp_path), max_records=PER_BATCH)
    plan, exchanges, jobs = one_batch_plan(spark, pipe, kafka_settings, f"rp-{tmp_path.name}")
    assert exchanges == 1, plan
    assert jobs == exchanges + 1, f"a dataflow batch ran {jobs} Spark jobs"


T0 = 1_767_225_600_000  # 2026-01-01T00:00Z: Kafka timestamps, by which backfills select
INTERVALS = [(T0, T0 + 50_000), (T0 + 50_000, T0 + 100_000), (T0 + 100_000, T0 + 151_000)]


@pytest.fixture(scope="module")
def stamped_topic(bootstrap, admin) -> dict[str, Any]:
    """The values with Kafka timestamps, value ``i`` at ``T0 + 1000 * i``, kept forever."""
    from kafka import KafkaProducer

    name = f"risky-bf-{uuid.uuid4().hex[:10]}"
    spec = {"num_partitions": 3, "replication_factor": 1, "configs": {"retention.ms": "-1"}}
    admin.create_topics({name: spec}, wait_for_metadata=True)
    producer = KafkaProducer(bootstrap_servers=bootstrap, acks="all")
    futures = [producer.send(name, value=v, key=v[:12], timestamp_ms=T0 + 1_000 * i)
               for i, v in enumerate(VALUES)]  # fmt: skip
    producer.flush()
    placed = [(f.get(30).partition, f.get(30).offset) for f in futures]
    producer.close()
    return {"name": name, "placed": placed}


def visible_files(root: Path) -> dict[str, list[bytes]]:
    """Each output sink's visible files, in batch order."""
    out = {}
    for sink in ("windows", "alerts", "quiet", "merchants"):
        store = open_store(str(root / sink))
        entries = ps.commit_entries(store)
        out[sink] = [store.get(k) for b in ps.visible_batches(entries) for k in entries[b]["files"]]
    return out


def test_a_backfill_rewrites_the_same_outputs(spark, kafka_settings, stamped_topic, tmp_path):
    """Three scheduled intervals, then the last two backfilled: every step's state is
    rewound, and the same files come back, equal to the reference; the dead letter too,
    naming the backfill's batch."""
    pipe = risky_payments(stamped_topic["name"], str(tmp_path))

    def interval(i: int, backfill: bool) -> Any:
        start, end = INTERVALS[i]
        options = BatchOptions(interval_start_ms=start, until_timestamp_ms=end,
                               backfill=backfill, run_id=f"i{i}-{backfill}")  # fmt: skip
        return BatchRunner(spark, pipe, kafka_settings).run(options)

    assert sum(interval(i, backfill=False).records_in for i in range(3)) == len(VALUES)
    scheduled = visible_files(tmp_path)
    dead = [{**d, "batch_id": None} for d in rows(tmp_path, "dead")]
    want = reference(VALUES, watermark_of(range(150), stamped_topic["placed"]))
    assert outcome(tmp_path) == want and want["alerts"]

    first = interval(1, backfill=True)
    assert first.rewind is not None
    interval(2, backfill=True)
    assert visible_files(tmp_path) == scheduled
    assert outcome(tmp_path) == want
    assert [{**d, "batch_id": None} for d in rows(tmp_path, "dead")] == dead
