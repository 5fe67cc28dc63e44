"""OpenTelemetry metrics of each batch: records, dead letters, timings, enrichment.

Recorded through the OpenTelemetry *API* only, so they cost nothing and go nowhere unless
the process has a meter provider from the SDK: one set by the host (``opentelemetry-
instrument``, a test's ``InMemoryMetricReader``), or the OTLP exporter that
:func:`setup_from_env` installs when ``OTEL_EXPORTER_OTLP_ENDPOINT`` (or
``..._METRICS_ENDPOINT``) is set — what ``microbatch run`` does, so a job started by
Airflow exports its batches when its environment names a collector. Without
``opentelemetry-api`` installed, recording does nothing.

Instruments (attribute ``pipeline`` on each, plus the ones listed):

==================================  =========  ======  ==================================
name                                kind       unit    attributes, meaning
==================================  =========  ======  ==================================
``microbatch.batch.count``          counter    {batch} ``status`` (committed, dry_run),
                                                       ``replayed``
``microbatch.batch.failures``       counter    {batch} ``reason`` (``ExitCode.reason``)
``microbatch.batch.records_in``     counter    {record} records read from Kafka
``microbatch.batch.records_out``    counter    {record} ``sink``: records each sink wrote
``microbatch.batch.dead_letters``   counter    {record} ``reason``
``microbatch.batch.state_written``  counter    By      state bytes the checkpoint uploaded
``microbatch.batch.duration``       histogram  s       ``status``: the batch, end to end
``microbatch.batch.phase.duration`` histogram  s       ``phase`` (plan, spark, execute, ...)
``microbatch.batch.lag``            gauge      {record} records left in Kafka after it
``microbatch.enrich.reissued``      counter    {element} async elements re-issued from
                                                       the previous checkpoint
``microbatch.enrich.pending``       gauge      {element} async elements the checkpoint
                                                       holds for the next batch
==================================  =========  ======  ==================================

The enrichment pair comes from the committed checkpoint's stats, when the caller has them.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from microbatch.runtime.options import BatchResult
    from microbatch.runtime.records import BatchStats

log = logging.getLogger(__name__)
METER_NAME = "microbatch"


class BatchMetrics:
    """The instruments of one meter; :meth:`record` adds one batch to them.

    ``meter_provider``: default the process's global one (a no-op unless an SDK provider
    was set). Without ``opentelemetry-api``, every method does nothing.
    """

    def __init__(self, meter_provider: Any = None) -> None:
        try:
            from opentelemetry import metrics
        except ImportError:  # the library does not require OpenTelemetry
            self._meter = None
            return
        from microbatch import __version__

        provider = meter_provider or metrics.get_meter_provider()
        meter = self._meter = provider.get_meter(METER_NAME, __version__)
        self.batches = meter.create_counter(
            "microbatch.batch.count", "{batch}", "batches that ended, by status"
        )
        self.failures = meter.create_counter(
            "microbatch.batch.failures", "{batch}", "batches that failed, by reason"
        )
        self.records_in = meter.create_counter(
            "microbatch.batch.records_in", "{record}", "records read from Kafka"
        )
        self.records_out = meter.create_counter(
            "microbatch.batch.records_out", "{record}", "records written, per sink"
        )
        self.dead_letters = meter.create_counter(
            "microbatch.batch.dead_letters", "{record}", "records sent to the dead letters"
        )
        self.state_written = meter.create_counter(
            "microbatch.batch.state_written", "By", "state bytes a checkpoint uploaded"
        )
        self.duration = meter.create_histogram(
            "microbatch.batch.duration", "s", "a batch, end to end"
        )
        self.phase_duration = meter.create_histogram(
            "microbatch.batch.phase.duration", "s", "one phase of a batch"
        )
        self.lag = meter.create_gauge(
            "microbatch.batch.lag", "{record}", "records left in Kafka after the batch"
        )
        self.enrich_reissued = meter.create_counter(
            "microbatch.enrich.reissued", "{element}", "async elements re-issued"
        )
        self.enrich_pending = meter.create_gauge(
            "microbatch.enrich.pending", "{element}", "async elements pending in the checkpoint"
        )

    @property
    def exporting(self) -> bool:
        """Does anything collect these metrics (an SDK meter provider, not the API's
        no-op)? Callers skip work that only feeds metrics when not."""
        if self._meter is None:
            return False
        try:
            from opentelemetry.sdk.metrics import Meter
        except ImportError:
            return False
        return isinstance(self._meter, Meter)

    def record(self, result: BatchResult, stats: BatchStats | None = None) -> None:
        """Add the batch ``result`` (and its checkpoint's ``stats``, for enrichment)."""
        if self._meter is None:
            return
        base = {"pipeline": result.pipeline}
        self.batches.add(1, {**base, "status": result.status, "replayed": result.replayed})
        self.records_in.add(result.records_in, base)
        for sink, n in sorted(result.outputs.items()):
            self.records_out.add(n, {**base, "sink": sink})
        reasons = dict(result.dead_letter_reasons)
        unexplained = result.dead_letters - sum(reasons.values())
        if unexplained > 0:
            reasons["unknown"] = reasons.get("unknown", 0) + unexplained
        for reason, n in sorted(reasons.items()):
            self.dead_letters.add(n, {**base, "reason": reason})
        self.state_written.add(result.state_bytes_written, base)
        for phase, seconds in sorted(result.seconds.items()):
            if phase == "total":
                self.duration.record(seconds, {**base, "status": result.status})
            else:
                self.phase_duration.record(seconds, {**base, "phase": phase})
        self.lag.set(sum(result.lag.values()), base)
        if stats is not None:
            self.enrich_reissued.add(stats.enrich_reissued, base)
            self.enrich_pending.set(stats.enrich_pending, base)

    def record_failure(self, reason: str, pipeline: str) -> None:
        """Count a batch that failed (``reason``: its ``ExitCode.reason``)."""
        if self._meter is not None:
            self.failures.add(1, {"pipeline": pipeline, "reason": reason})


def setup_from_env(env: Mapping[str, str] | None = None) -> bool:
    """Install an OTLP-exporting meter provider as the global one when ``env`` names a
    collector (``OTEL_EXPORTER_OTLP_ENDPOINT`` or ``OTEL_EXPORTER_OTLP_METRICS_ENDPOINT``;
    protocol ``OTEL_EXPORTER_OTLP_PROTOCOL``, default ``http/protobuf``) and metrics are not
    turned off (``OTEL_SDK_DISABLED=true``, ``OTEL_METRICS_EXPORTER=none``). The provider
    exports what is left when the process exits. Returns whether it installed one.
    """
    env = os.environ if env is None else env
    endpoint = env.get("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT") or env.get(
        "OTEL_EXPORTER_OTLP_ENDPOINT"
    )
    if not endpoint or env.get("OTEL_SDK_DISABLED", "").lower() == "true":
        return False
    if env.get("OTEL_METRICS_EXPORTER", "otlp").lower() == "none":
        return False
    protocol = env.get("OTEL_EXPORTER_OTLP_METRICS_PROTOCOL") or env.get(
        "OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf"
    )
    try:
        from opentelemetry import metrics
        from opentelemetry.sdk.metrics import MeterProvider
        from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
        from opentelemetry.sdk.resources import Resource

        if protocol == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import (
                OTLPMetricExporter,
            )
        else:
            from opentelemetry.exporter.otlp.proto.http.metric_exporter import (  # type: ignore[assignment]
                OTLPMetricExporter,
            )
    except ImportError as e:
        log.warning(
            "OTEL_EXPORTER_OTLP_ENDPOINT=%s is set but OpenTelemetry's SDK or OTLP exporter "
            "is not installed (%s): batch metrics are not exported. Install "
            "opentelemetry-sdk and opentelemetry-exporter-otlp.",
            endpoint, e,
        )  # fmt: skip
        return False
    resource = Resource.create({} if env.get("OTEL_SERVICE_NAME") else {"service.name": METER_NAME})
    reader = PeriodicExportingMetricReader(OTLPMetricExporter())
    metrics.set_meter_provider(MeterProvider(resource=resource, metric_readers=[reader]))
    return True
