"""docs/dataflow.md runs as written: its code blocks, in order, build the payments
dataflow, which then runs on real Kafka and Spark and gives a plain-Python reference's
output."""

from __future__ import annotations

import json
import re
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

from microbatch.runtime import BatchOptions, BatchRunner
from microbatch.sinks import read_parquet_sink
from tests.integration.dataflow.payments import payment, reference
from tests.integration.runtime.test_batches import new_topic, produce

pytestmark = pytest.mark.integration

DOC = Path(__file__).resolve().parents[3] / "docs" / "dataflow.md"
VALUES = [payment(i) for i in range(120)]


def code_blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def test_the_guide_has_code_to_run() -> None:
    assert len(code_blocks(DOC.read_text())) >= 5


def takings_reference(values: list[bytes], watermark: int) -> list[dict[str, Any]]:
    """Hopping windows of 10 s every 5 s per merchant, closed by ``watermark``."""
    sums: dict[tuple[str, int], int] = defaultdict(int)
    for v in values:
        p = json.loads(v)
        if p["amount"] <= 0:
            continue
        last_start = p["ts"] // 5_000 * 5_000
        for start in (last_start - 5_000, last_start):
            sums[(p["merchant"], start)] += p["amount"]
    return sorted(
        (
            {"key": m, "window_start": s, "window_end": s + 10_000, "sum_amount": n}
            for (m, s), n in sums.items()
            if s + 10_000 <= watermark
        ),
        key=lambda r: (r["key"], r["window_start"]),
    )


def test_the_guide_runs_and_its_dataflow_gives_the_reference_output(
    spark, kafka_settings, bootstrap, admin, tmp_path, monkeypatch
) -> None:
    topic = new_topic(admin, 3)
    produce(bootstrap, topic, VALUES)
    monkeypatch.setenv("PAYMENTS_ROOT", str(tmp_path))
    monkeypatch.setenv("PAYMENTS_TOPIC", topic)
    namespace: dict[str, Any] = {"__name__": "docs_dataflow"}
    for block in code_blocks(DOC.read_text()):
        exec(compile(block, str(DOC), "exec"), namespace)
    pipeline = namespace["pipeline"]

    first = BatchRunner(spark, pipeline, kafka_settings).run(BatchOptions(run_id="a"))
    assert first.records_in == len(VALUES)
    last = BatchRunner(spark, pipeline, kafka_settings).run(BatchOptions(run_id="b"))

    def rows(name: str, *order: str) -> list[dict[str, Any]]:
        got = read_parquet_sink(str(tmp_path / name)).to_pylist()
        return sorted(got, key=lambda r: tuple(r[c] for c in order))

    want = reference(VALUES)
    assert rows("card-totals", "card", "ts") == want["charges"]
    assert rows("alerts", "card") == want["alerts"]
    assert [r["card"] for r in rows("idle", "card")] == ["c6"]
    takings = rows("takings", "key", "window_start")
    assert takings and takings == takings_reference(VALUES, last.watermark)

    # The refund audit: a dataflow without keyed steps, columns from source to sink.
    BatchRunner(spark, namespace["refunds"], kafka_settings).run(BatchOptions(run_id="r"))
    payments = [json.loads(v) for v in VALUES]
    want_refunds = [
        {"card": p["card"], "merchant": p["merchant"], "ts": p["ts"], "refund": -p["amount"]}
        for p in payments
        if p["amount"] <= 0
    ]
    assert want_refunds and rows("refunds", "ts") == want_refunds
