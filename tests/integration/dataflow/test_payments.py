"""The payments dataflow (three stateless steps, two keyed steps, side outputs, timers)
as one pipeline: its outputs equal a plain-Python reference, batch after batch, across
crashes and rescales; one manifest holds both steps' state."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from microbatch.checkpoint import Layout, latest_manifest
from microbatch.runtime import CRASH_POINTS, BatchOptions, BatchRunner
from microbatch.sinks import read_parquet_sink
from microbatch.storage import open_store
from tests.integration.dataflow.payments import payment, payments_dataflow, reference
from tests.integration.dataflow.plans import one_batch_plan
from tests.integration.runtime.test_batches import new_topic, produce

pytestmark = pytest.mark.integration

VALUES = [payment(i) for i in range(120)] + [b"not json"]


@pytest.fixture(scope="module")
def topic(bootstrap, admin) -> str:
    name = new_topic(admin, 3)
    produce(bootstrap, name, VALUES)
    return name


def rows(root: Path, sink: str) -> list[dict[str, Any]]:
    return read_parquet_sink(str(root / sink)).to_pylist()


def outcome(root: Path) -> dict[str, Any]:
    merchants: dict[str, dict[str, int]] = {}
    for r in rows(root, "merchants"):  # each batch's running totals: keep the largest
        if r["count"] > merchants.get(r["merchant"], {"count": -1})["count"]:
            merchants[r["merchant"]] = {"count": r["count"], "sum": r["sum"]}
    return {
        "charges": sorted(rows(root, "charges"), key=lambda r: (r["card"], r["ts"])),
        "alerts": sorted(rows(root, "alerts"), key=lambda r: r["card"]),
        "merchants": dict(sorted(merchants.items())),
    }


def run_batches(spark, settings, topic: str, root: Path, parallelisms: list[int], **kw) -> list:
    pipe = payments_dataflow(topic, str(root))
    per_batch = -(-len(VALUES) // len(parallelisms))
    pipe = _capped(pipe, per_batch)
    return [
        BatchRunner(spark, pipe, settings).run(BatchOptions(run_id=f"r{i}", parallelism=p, **kw))
        for i, p in enumerate(parallelisms)
    ]


def _capped(pipe, n: int):
    import dataclasses

    return dataclasses.replace(
        pipe, source=dataclasses.replace(pipe.source, max_records_per_batch=n)
    )


@pytest.fixture(scope="module")
def clean(spark, kafka_settings, topic, tmp_path_factory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("clean")
    results = run_batches(spark, kafka_settings, topic, root, [2, 2, 2])
    return {"root": root, "results": results, "outcome": outcome(root)}


def test_one_pipeline_gives_the_reference_outputs(clean) -> None:
    want = reference(VALUES)
    got = clean["outcome"]
    assert got["charges"] == want["charges"]
    assert got["alerts"] == want["alerts"]
    assert got["merchants"] == want["merchants"]
    dead = rows(clean["root"], "dead")
    assert [d["reason"] for d in dead] == ["undecodable"]
    assert sum(r.records_in for r in clean["results"]) == len(VALUES)


def test_one_manifest_holds_the_state_of_both_keyed_steps(clean) -> None:
    manifest = latest_manifest(open_store(str(clean["root"] / "checkpoints")), Layout())
    assert list(manifest.operators) == ["merchant"]
    assert manifest.total_keys == 7  # cards
    assert sum(manifest.operators["merchant"].key_counts) == 3  # merchants
    assert manifest.files() >= {r.data for r in manifest.operators["merchant"].runs}


def test_timers_of_the_first_step_fire_as_the_watermark_passes_them(clean) -> None:
    idle = rows(clean["root"], "idle")
    assert [r["card"] for r in idle] == ["c6"], "timers of step 'spend' did not fire once"
    # c6 pays at i % 7 == 6 until i = 60, but i % 11 == 0 is a refund, filtered out
    last_payment = max(i for i in range(60) if i % 7 == 6 and i % 11) * 1_000
    assert idle[0]["idle_since"] == last_payment + 30_000


def test_rescaling_between_batches_changes_no_output(
    clean, spark, kafka_settings, topic, tmp_path
) -> None:
    run_batches(spark, kafka_settings, topic, tmp_path, [2, 3, 1, 4])
    assert outcome(tmp_path) == clean["outcome"]


def test_a_reshard_between_batches_moves_every_steps_state(
    clean, spark, kafka_settings, topic, tmp_path
) -> None:
    """Batch 1 at max_parallelism 16, ``microbatch reshard`` to 32 (both keyed steps'
    state re-assigned and checked), the rest at 32: the outputs of the clean run."""
    import dataclasses

    from microbatch.checkpoint import reshard
    from microbatch.runtime.records import BatchRecord, ReshardOrigin

    pipe = _capped(payments_dataflow(topic, str(tmp_path)), 40)
    BatchRunner(spark, pipe, kafka_settings).run(BatchOptions(run_id="r0"))
    store = open_store(str(tmp_path / "checkpoints"))
    before = latest_manifest(store, Layout())
    record = dataclasses.replace(
        BatchRecord.of(before), resharded_from=ReshardOrigin(before.checkpoint_id, 16)
    )
    after = reshard(store, Layout(), before.checkpoint_id, 32, metadata=record.to_json()).target
    assert after.max_parallelism == 32 and list(after.operators) == ["merchant"]
    assert sum(after.operators["merchant"].key_counts) == sum(
        before.operators["merchant"].key_counts
    )
    wider = dataclasses.replace(pipe, max_parallelism=32)
    for i in (1, 2):
        BatchRunner(spark, wider, kafka_settings).run(BatchOptions(run_id=f"r{i}", parallelism=3))
    assert outcome(tmp_path) == clean["outcome"]
    assert rows(tmp_path, "idle") == rows(clean["root"], "idle")


@pytest.mark.parametrize("crash_at", CRASH_POINTS)
def test_a_crash_then_a_rerun_equals_the_clean_run(
    crash_at, clean, spark, kafka_settings, topic, tmp_path
) -> None:
    pipe = _capped(payments_dataflow(topic, str(tmp_path)), 61)
    BatchRunner(spark, pipe, kafka_settings).run(BatchOptions(run_id="r0"))
    with pytest.raises(Exception, match="injected crash"):
        BatchRunner(spark, pipe, kafka_settings).run(BatchOptions(run_id="r1", crash_at=crash_at))
    BatchRunner(spark, pipe, kafka_settings).run(BatchOptions(run_id="r1", parallelism=3))
    if crash_at == "after_commit":  # the crashed attempt committed batch 1: one more
        BatchRunner(spark, pipe, kafka_settings).run(BatchOptions(run_id="r2", parallelism=3))
    assert outcome(tmp_path) == clean["outcome"]
    assert rows(tmp_path, "idle") == rows(clean["root"], "idle")


def test_a_single_operator_checkpoint_carries_on_as_the_first_steps_state(
    spark, kafka_settings, bootstrap, admin, tmp_path
) -> None:
    """Today's ``Pipeline`` runs a batch; the dataflow with the same first step takes over
    its checkpoint: the card totals carry on, and the merchant step starts empty."""
    from microbatch.runtime import KafkaSource, ParquetSink, Pipeline
    from tests.integration.dataflow.payments import SpendPerCard

    positive = [v for v in VALUES[:-1] if b'"amount": -' not in v]
    topic = new_topic(admin, 3)
    produce(bootstrap, topic, positive[:50])
    legacy = Pipeline(
        name="payments",
        source=KafkaSource(topics=(topic,)),
        key_by="card",
        process=SpendPerCard(),
        sinks=[ParquetSink("alerts", f"{tmp_path}/legacy-alerts")],
        checkpoints=f"{tmp_path}/checkpoints",
        max_parallelism=16,
        parallelism=2,
    )
    BatchRunner(spark, legacy, kafka_settings).run(BatchOptions(run_id="legacy"))
    produce(bootstrap, topic, positive[50:])
    flow = payments_dataflow(topic, str(tmp_path))
    BatchRunner(spark, flow, kafka_settings).run(BatchOptions(run_id="flow"))

    want = reference(positive)
    later = {json.loads(v)["ts"] for v in positive[50:]}
    assert rows(tmp_path, "charges") and sorted(
        rows(tmp_path, "charges"), key=lambda r: (r["card"], r["ts"])
    ) == [c for c in want["charges"] if c["ts"] in later]
    merchants = {r["merchant"]: r["count"] for r in rows(tmp_path, "merchants")}
    assert sum(merchants.values()) == len(positive) - 50  # the new step saw only its batch


def test_each_steps_state_is_read_by_its_uid(clean) -> None:
    from microbatch.checkpoint.inspection import describe_checkpoint, inspect_key

    store = open_store(str(clean["root"] / "checkpoints"))
    manifest = latest_manifest(store, Layout())
    merchant = inspect_key(store, Layout(), "m1", step="merchant")
    want = reference(VALUES)["merchants"]["m1"]
    assert merchant.values == {"count": want["count"], "sum": want["sum"]}
    card = inspect_key(store, Layout(), "c1")  # the first step's
    assert "total" in card.values and card.timers
    assert inspect_key(store, Layout(), "m1").empty  # no card is called m1
    steps = describe_checkpoint(store, Layout(), manifest.checkpoint_id)["steps"]
    assert steps["merchant"]["keys"] == 3
    assert steps["merchant"]["process"].endswith("payments.MerchantTotals")


def test_a_batch_is_one_spark_query_with_one_exchange_per_keyed_step(
    spark, kafka_settings, topic, tmp_path
) -> None:
    pipe = _capped(payments_dataflow(topic, str(tmp_path)), 60)
    plan, exchanges, jobs = one_batch_plan(spark, pipe, kafka_settings, f"df-{tmp_path.name}")
    assert exchanges == 2, plan  # the card step's and the merchant step's
    # One query (one action): adaptive execution submits each shuffle stage as a job of
    # its own, then the result stage; nothing else reads Kafka or recomputes a step.
    assert jobs == exchanges + 1, f"a dataflow batch ran {jobs} Spark jobs"


def test_a_replay_rolls_back_every_steps_state_and_output(
    clean, spark, kafka_settings, topic, tmp_path
) -> None:
    pipe = _capped(payments_dataflow(topic, str(tmp_path)), 41)
    for run in ("r0", "r1", "r2"):
        BatchRunner(spark, pipe, kafka_settings).run(BatchOptions(run_id=run))
    BatchRunner(spark, pipe, kafka_settings).replay_from(0)
    for run in ("again1", "again2"):
        BatchRunner(spark, pipe, kafka_settings).run(BatchOptions(run_id=run))
    assert outcome(tmp_path) == clean["outcome"]


def test_the_cli_shows_a_keys_state_in_the_step_it_names(clean, topic, kafka_settings, capsys):
    from microbatch.cli import main

    job = clean["root"] / "job.py"
    job.write_text(
        "from tests.integration.dataflow.payments import payments_dataflow\n"
        f"pipeline = payments_dataflow({topic!r}, {str(clean['root'])!r})\n"
    )
    env_args = ["state", str(job), "m2", "--step", "merchant", "--json"]
    assert main(env_args) == 0
    shown = json.loads(capsys.readouterr().out)
    want = reference(VALUES)["merchants"]["m2"]
    assert shown["step"] == "merchant" and shown["state"] == want
    assert main(["state", str(job), "m2", "--step", "nope"]) == 6  # NOT_FOUND
    assert "has no keyed step 'nope' (its steps: 'spend', 'merchant')" in capsys.readouterr().err
