"""The issue's payments job — enrichment, hopping windows per card, alerts with timers, a
branch per merchant — as one dataflow: its outputs equal a plain-Python reference, and
stay equal across rescales and a crash at every point followed by a rerun."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from microbatch.runtime import CRASH_POINTS, BatchOptions, BatchRunner
from microbatch.sinks import read_parquet_sink
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
    latest: dict[int, int] = {}
    for i, (part, _) in enumerate(placed[:150]):
        latest[part] = max(latest.get(part, 0), 1_000 * i)
    return {"name": name, "watermark": min(latest.values())}


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
    """Three keyed steps in two levels — the windows per card and the merchants (both
    read the source), then the alerts — so the batch's one query has two exchanges."""
    pipe = risky_payments(topic["name"], str(tmp_path), max_records=PER_BATCH)
    plan, exchanges, jobs = one_batch_plan(spark, pipe, kafka_settings, f"rp-{tmp_path.name}")
    assert exchanges == 2, plan
    assert jobs == exchanges + 1, f"a dataflow batch ran {jobs} Spark jobs"
