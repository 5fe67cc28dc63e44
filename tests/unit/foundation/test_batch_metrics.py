"""Each batch's OpenTelemetry metrics, read back with the SDK's in-memory reader."""

from __future__ import annotations

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from microbatch.metrics import BatchMetrics, setup_from_env
from microbatch.runtime.options import BatchResult
from microbatch.runtime.records import BatchStats


@pytest.fixture
def reader() -> InMemoryMetricReader:
    return InMemoryMetricReader()


def points(reader: InMemoryMetricReader) -> dict[str, list]:
    """Metric name → its data points, as the SDK exports them."""
    data = reader.get_metrics_data()
    out: dict[str, list] = {}
    for resource in data.resource_metrics if data else ():
        for scope in resource.scope_metrics:
            assert scope.scope.name == "microbatch"
            for metric in scope.metrics:
                out[metric.name] = list(metric.data.data_points)
    return out


def by(points_: list, key: str) -> dict:
    return {p.attributes[key]: p for p in points_}


def committed_batch() -> BatchResult:
    result = BatchResult("clickstream", 7, 3, "committed", replayed=True)
    result.records_in = 500
    result.dead_letters = 12
    result.dead_letter_reasons = {"decode": 10, "late": 2}
    result.outputs = {"sessions": 40, "sessions_topic": 40}
    result.lag = {"clicks[0]": 5, "clicks[1]": 0}
    result.state_bytes_written = 4096
    result.seconds = {"plan": 0.25, "execute": 3.5, "commit": 0.125, "total": 4.0}
    return result


def test_a_committed_batch_records_its_counts_timings_and_enrichment(reader):
    metrics = BatchMetrics(MeterProvider(metric_readers=[reader]))
    assert metrics.exporting

    metrics.record(committed_batch(), BatchStats(enrich_pending=3, enrich_reissued=9))

    got = points(reader)
    (batches,) = got["microbatch.batch.count"]
    assert batches.value == 1
    assert dict(batches.attributes) == {"pipeline": "clickstream", "status": "committed",
                                        "replayed": True}  # fmt: skip
    assert got["microbatch.batch.records_in"][0].value == 500
    assert {s: p.value for s, p in by(got["microbatch.batch.records_out"], "sink").items()} == {
        "sessions": 40,
        "sessions_topic": 40,
    }
    dead = by(got["microbatch.batch.dead_letters"], "reason")
    assert {r: p.value for r, p in dead.items()} == {"decode": 10, "late": 2}
    assert got["microbatch.batch.state_written"][0].value == 4096
    (total,) = got["microbatch.batch.duration"]
    assert total.sum == 4.0 and total.count == 1
    phases = by(got["microbatch.batch.phase.duration"], "phase")
    assert {ph: p.sum for ph, p in phases.items()} == {"plan": 0.25, "execute": 3.5,
                                                       "commit": 0.125}  # fmt: skip
    assert got["microbatch.batch.lag"][0].value == 5
    assert got["microbatch.enrich.reissued"][0].value == 9
    assert got["microbatch.enrich.pending"][0].value == 3


def test_counters_add_up_over_batches_and_failures_count_by_reason(reader):
    metrics = BatchMetrics(MeterProvider(metric_readers=[reader]))

    metrics.record(committed_batch())
    metrics.record(committed_batch())
    metrics.record_failure("lease_held", "clickstream")

    got = points(reader)
    assert got["microbatch.batch.records_in"][0].value == 1000
    assert got["microbatch.batch.duration"][0].count == 2
    (failure,) = got["microbatch.batch.failures"]
    assert failure.value == 1 and failure.attributes["reason"] == "lease_held"
    assert "microbatch.enrich.reissued" not in got  # no stats were given


def test_dead_letters_without_a_recorded_reason_are_counted_as_unknown(reader):
    result = committed_batch()
    result.dead_letter_reasons = {"decode": 10}  # 2 of 12 without a reason

    BatchMetrics(MeterProvider(metric_readers=[reader])).record(result)

    dead = by(points(reader)["microbatch.batch.dead_letters"], "reason")
    assert {r: p.value for r, p in dead.items()} == {"decode": 10, "unknown": 2}


def test_without_an_sdk_provider_recording_is_a_no_op_and_nothing_is_exported():
    metrics = BatchMetrics()  # the process's global provider: the API's no-op here

    metrics.record(committed_batch())  # must not fail

    assert not metrics.exporting


@pytest.mark.parametrize(
    "env",
    [
        {},
        {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318", "OTEL_SDK_DISABLED": "true"},
        {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318", "OTEL_METRICS_EXPORTER": "none"},
    ],
)
def test_no_exporter_is_installed_unless_a_collector_is_named_and_metrics_are_on(env):
    assert setup_from_env(env) is False
