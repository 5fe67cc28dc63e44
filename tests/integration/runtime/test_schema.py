"""Declared value schemas on the real runtime (Kafka, Spark, local checkpoints): both
readers give the output of the same pipeline without a schema, and the same dead letters
``schema_mismatch`` naming the field; windows take the decoded columns."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from microbatch import windows
from microbatch.runtime import (
    BatchOptions,
    BatchRunner,
    DeadLetterSink,
    EventTime,
    KafkaSource,
    ParquetSink,
    Pipeline,
)
from microbatch.runtime.schema import JsonSchema
from microbatch.sinks import read_parquet_sink
from tests.integration.runtime.pipelines import click, count_pipeline
from tests.integration.runtime.test_batches import clicks, new_topic, produce, totals

pytestmark = pytest.mark.integration

CLICK = JsonSchema({"user": "string", "page": "string", "ts": "long"})
BAD = [
    click("u1", "/p0", ts="yesterday"),  # wrong type
    json.dumps({"user": "u2", "ts": 5}).encode(),  # a field missing
    b"<html>not json</html>",
    click(None, "/p1", ts=3),  # null in a non-nullable field
    click(42, "/p2", ts=4),  # a number where a string is declared: not "42"
]
#: What each bad value's dead letter says (the field named where one is wrong).
ERRORS = [
    "field 'ts': expected long, got string \"yesterday\"",
    "field 'page' is missing (declared string, not nullable)",
    "value is not JSON: Expecting value: line 1 column 1 (char 0)",
    "field 'user' is null (declared string, not nullable)",
    "field 'user': expected string, got integer 42",
]


def declared(topic: str, root: Path, reader: str) -> Pipeline:
    plain = count_pipeline(topic, str(root))
    source = KafkaSource(topics=(topic,), value_schema=CLICK, reader=reader)  # type: ignore[arg-type]
    return dataclasses.replace(plain, source=source)


def counts(root: Path) -> list[tuple[str, int, int]]:
    rows = read_parquet_sink(str(root / "counts")).to_pylist()
    return sorted((r["user"], r["clicks"], r["total"]) for r in rows)


@pytest.mark.parametrize("reader", ["spark", "python"])
def test_both_readers_count_as_without_a_schema_and_dead_letter_mismatches(
    spark, kafka_settings, bootstrap, admin, tmp_path: Path, reader: str
) -> None:
    topic, good_topic = new_topic(admin, 2), new_topic(admin, 2)
    pipelines = {
        "declared": declared(topic, tmp_path / "declared", reader),
        "plain": count_pipeline(good_topic, str(tmp_path / "plain")),
    }
    batches = [[*clicks(40, seed=1), *BAD], clicks(30, seed=2)]
    placed_bad = []
    for n, values in enumerate(batches):
        placed = produce(bootstrap, topic, values)
        produce(bootstrap, good_topic, [v for v in values if v not in BAD])
        placed_bad += [p for p, v in zip(placed, values, strict=True) if v in BAD]
        for name, pipeline in pipelines.items():
            runner = BatchRunner(spark, pipeline, kafka_settings)
            result = runner.run(BatchOptions(run_id=f"r{n}", parallelism=2 + n))  # rescaled
            if name == "declared":
                assert runner.stage_one_reader == reader
                wanted = {"schema_mismatch": len(BAD)} if n == 0 else {}
                assert result.dead_letter_reasons == wanted

    assert counts(tmp_path / "declared") == counts(tmp_path / "plain")
    final: dict[str, int] = {}
    for user, _, total in counts(tmp_path / "declared"):
        final[user] = max(final.get(user, 0), total)
    assert final == totals([v for values in batches for v in values if v not in BAD])
    dead = read_parquet_sink(str(tmp_path / "declared" / "dead")).to_pylist()
    got = sorted((d["partition"], d["offset"], d["reason"], d["error"], d["raw_value"])
                 for d in dead)  # fmt: skip
    assert got == sorted(
        (p, o, "schema_mismatch", e, v)
        for (p, o), e, v in zip(placed_bad, ERRORS, BAD, strict=True)
    )


def window_pipeline(name: str, topic: str, root: Path, schema: JsonSchema | None) -> Pipeline:
    return Pipeline(
        name=f"win-{name}",
        source=KafkaSource(topics=(topic,), value_schema=schema),
        key_by="user",
        process=windows.tumbling("1m").count().sum("amount").max("amount").final(),
        event_time=EventTime("ts", idle_timeout_s=None),
        sinks=[ParquetSink("out", str(root / "out"))],
        dead_letters=DeadLetterSink(path=str(root / "dead"), max_ratio=1.0),
        checkpoints=str(root / "checkpoints"),
        max_parallelism=16,
        parallelism=2,
    )


def test_windows_take_the_declared_columns_and_give_the_same_windows(
    spark, kafka_settings, bootstrap, admin, tmp_path: Path
) -> None:
    topic, good_topic = new_topic(admin, 2), new_topic(admin, 2)
    values = [
        json.dumps({"user": f"u{i % 3}", "ts": i * 7_000, "amount": i % 5}).encode()
        for i in range(60)
    ]
    flush = [json.dumps({"user": "z", "ts": 10**12, "amount": 0}).encode()] * 4
    produce(bootstrap, topic, [*values, b'{"user": "u1", "ts": 1, "amount": "lots"}', *flush])
    produce(bootstrap, good_topic, [*values, *flush])
    schema = JsonSchema({"user": "string", "ts": "long", "amount": "long"})
    outputs = {}
    for name, source_topic, declared_schema in [
        ("plain", good_topic, None),
        ("declared", topic, schema),
    ]:
        root = tmp_path / name
        pipeline = window_pipeline(name, source_topic, root, declared_schema)
        BatchRunner(spark, pipeline, kafka_settings).run(BatchOptions(run_id="r"))
        rows = read_parquet_sink(str(root / "out")).to_pylist()
        outputs[name] = sorted(
            (r["key"], r["window_start"], r["count"], r["sum_amount"], r["max_amount"])
            for r in rows
        )
        dead = read_parquet_sink(str(root / "dead")).to_pylist()
        outputs[f"{name}-dead"] = [(d["reason"], d["error"]) for d in dead]

    assert outputs["declared-dead"] == [
        ("schema_mismatch", "field 'amount': expected long, got string \"lots\"")
    ]
    assert outputs["declared"] == outputs["plain"]
    expected: dict[tuple[str, int], list[int]] = {}
    for v in values:
        e = json.loads(v)
        w = expected.setdefault((e["user"], e["ts"] - e["ts"] % 60_000), [0, 0, 0])
        w[0] += 1
        w[1] += e["amount"]
        w[2] = max(w[2], e["amount"])
    got = [o for o in outputs["declared"] if o[0] != "z"]
    assert got == sorted((*k, *w) for k, w in expected.items())
