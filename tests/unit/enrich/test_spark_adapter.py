"""The mapInArrow body without Spark: rows in, output/dead-letter/pending rows out."""

from __future__ import annotations

import asyncio
import functools
import time

import pyarrow as pa
import pytest

from microbatch.enrich import AsyncOperator, NoRetry
from microbatch.enrich.spark import ENRICH_SCHEMA, enrich_partition
from microbatch.errors import EnrichmentError
from microbatch.state.codec import decode_value, encode_value


async def lookup(record: dict, slow: frozenset[int]) -> dict | None:
    if record["id"] in slow:
        await asyncio.sleep(5)
    if record["id"] == 13:
        raise LookupError("no such user")
    return {**record, "name": f"user-{record['id']}"}


def make_operator(slow: frozenset[int] = frozenset()) -> AsyncOperator:
    return AsyncOperator(
        functools.partial(lookup, slow=slow),
        mode="ordered",
        capacity=8,
        timeout_s=None,
        retry=NoRetry(),
        on_failure="dead_letter",
    )


def batch(ids, attempts=None, first_ms=None) -> pa.RecordBatch:
    columns = {
        "topic": pa.array(["users"] * len(ids), pa.string()),
        "partition": pa.array([2] * len(ids), pa.int32()),
        "offset": pa.array(ids, pa.int64()),
        "payload": pa.array([encode_value({"id": i}) for i in ids], pa.binary()),
    }
    if attempts is not None:
        columns["attempts"] = pa.array(attempts, pa.int32())
        columns["first_attempt_ms"] = pa.array(first_ms, pa.int64())
    return pa.RecordBatch.from_pydict(columns)


def rows(batches) -> list[dict]:
    table = pa.Table.from_batches(list(batches), schema=ENRICH_SCHEMA)
    return table.to_pylist()


def test_rows_become_outputs_and_dead_letters():
    out = rows(enrich_partition(iter([batch([1, 2]), batch([13])]), make_operator))

    assert [(r["kind"], r["offset"]) for r in out] == [
        ("output", 1),
        ("output", 2),
        ("dead_letter", 13),
    ]
    assert decode_value(out[0]["payload"]) == {"id": 1, "name": "user-1"}
    assert decode_value(out[2]["payload"]) == {"id": 13}
    assert out[2]["reason"] == "error" and out[2]["attempts"] == 1
    assert "LookupError" in out[2]["error"] and out[2]["first_attempt_ms"] > 0


def test_deadline_yields_pending_rows_that_a_second_pass_finishes():
    make = functools.partial(make_operator, slow=frozenset({2}))
    first = rows(enrich_partition(iter([batch(list(range(5)))]), make, time.time() + 0.2))
    pending = [r for r in first if r["kind"] == "pending"]
    again = batch(
        [r["offset"] for r in pending],
        [r["attempts"] for r in pending],
        [r["first_attempt_ms"] for r in pending],
    )

    second = rows(enrich_partition(iter([again, batch([5])]), make_operator))

    assert [r["offset"] for r in first if r["kind"] == "output"] == [0, 1]
    assert [r["offset"] for r in pending] == [2, 3, 4]
    assert [r["offset"] for r in second] == [2, 3, 4, 5]
    assert {r["kind"] for r in second} == {"output"}


def test_pending_rows_after_new_rows_are_refused():
    late = batch([7], [0], [None])

    with pytest.raises(EnrichmentError, match="must come first"):
        list(enrich_partition(iter([batch([1]), late]), make_operator))


def test_empty_partition_yields_nothing():
    assert list(enrich_partition(iter([]), make_operator)) == []
