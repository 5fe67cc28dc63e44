"""Latency metrics: a bounded reservoir that stays a uniform sample of the whole run."""

from __future__ import annotations

import random

from microbatch.enrich import EnrichMetrics


def test_latency_reservoir_keeps_every_sample_until_full() -> None:
    metrics = EnrichMetrics(reservoir_size=10)
    for i in range(10):
        metrics.observe_latency(i / 100)
    assert metrics.percentile(0.0) == 0.0 and metrics.percentile(1.0) == 0.09
    assert metrics.as_dict()["latency_p50_s"] == 0.05


def test_latency_reservoir_past_full_stays_bounded_and_uniform() -> None:
    n, size = 200_000, 1_000
    metrics = EnrichMetrics(reservoir_size=size, _rng=random.Random(7))
    for i in range(n):
        metrics.observe_latency(float(i))
    assert len(metrics._samples) == size
    # A uniform sample of 0..n-1: each decile holds ~10 % of it (binomial sd ~1 %).
    deciles = [0] * 10
    for s in metrics._samples:
        deciles[int(s * 10 // n)] += 1
    assert all(60 <= d <= 140 for d in deciles), deciles
    assert 0.45 * n < metrics.percentile(0.5) < 0.55 * n
