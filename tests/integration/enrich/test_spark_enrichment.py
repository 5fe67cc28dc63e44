"""The Spark adapter on the shared session: a deadline leaves pending rows, a second pass
re-issues them, and the two passes together equal one run without a deadline."""

from __future__ import annotations

import sys
import time
from collections import Counter

import pytest

from microbatch.enrich.spark import enrich_dataframe
from microbatch.state.codec import decode_value, encode_value

from . import conftest
from .conftest import operator_factory

pytestmark = pytest.mark.integration

INPUT_DDL = "topic string, partition int, offset bigint, payload binary"


@pytest.fixture(autouse=True)
def ship_helpers_by_value():
    """Spark workers cannot import the tests package: pickle its helpers by value."""
    from pyspark import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[conftest.__name__])
    yield
    cloudpickle.unregister_pickle_by_value(sys.modules[conftest.__name__])


def inputs(spark, ids):
    rows = [("users", i % 3, i, encode_value({"id": i})) for i in ids]
    return spark.createDataFrame(rows, INPUT_DDL).repartition(4)


def emitted(rows) -> Counter:
    return Counter(
        (r["kind"], r["topic"], r["partition"], r["offset"], bytes(r["payload"])) for r in rows
    )


def test_deadline_pass_then_reissue_pass_equals_one_run_without_deadline(spark, service):
    make = operator_factory(service.url, capacity=50, timeout_s=None)
    baseline = enrich_dataframe(inputs(spark, range(220)), make).collect()

    # Slow ids hang until released. With local[2], two tasks block until the deadline and
    # the other two start after it: all their inputs come back as never-started pending.
    service.slow_ids = service_slow(range(200))
    first = enrich_dataframe(inputs(spark, range(200)), make, time.time() + 5).collect()
    pending = [r for r in first if r["kind"] == "pending"]
    service.slow_ids = set()
    service.release()
    again = spark.createDataFrame(
        [
            (
                r["topic"],
                r["partition"],
                r["offset"],
                r["payload"],
                r["attempts"],
                r["first_attempt_ms"],
            )
            for r in pending
        ],
        INPUT_DDL + ", attempts int, first_attempt_ms bigint",
    ).unionByName(inputs(spark, range(200, 220)), allowMissingColumns=True)
    second = enrich_dataframe(again, make).collect()

    assert {r["kind"] for r in baseline} == {"output"} and len(baseline) == 220
    assert {r["offset"] for r in pending} >= service_slow(range(200))
    assert any(r["kind"] == "output" for r in first)
    assert {r["kind"] for r in first} <= {"output", "pending"}
    outputs = [r for r in first + second if r["kind"] == "output"]
    assert emitted(outputs) == emitted(baseline)  # each result exactly once
    # in flight at the deadline (first call recorded), or never started: both come back
    assert any(r["first_attempt_ms"] is not None for r in pending)
    assert decode_value(outputs[0]["payload"])["name"].startswith("user-")


def service_slow(ids) -> set[int]:
    return {i for i in ids if i % 10 == 0}
