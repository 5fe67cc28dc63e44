"""Counters and latency percentiles of one async operator, cheap enough to keep always on.

Latencies (admission → outcome, in seconds) go into a fixed-size reservoir sample, so
memory stays bounded whatever the element count and the percentiles stay representative
of the whole run. Once the reservoir is full, Li's algorithm L draws how many
observations to skip before the next replacement, so an observation that is not sampled
costs a counter increment and no random draw.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Any


@dataclass
class EnrichMetrics:
    """What happened to the elements of one operator (all counts are elements, not calls).

    - ``in_flight``: records admitted and not yet emitted (gauge);
    - ``completed``: elements whose function returned a result;
    - ``timed_out``: elements whose timeout fired before any result;
    - ``failed``: elements whose last attempt raised or returned an invalid value;
    - ``retried``: retries scheduled (one element can count several times);
    - ``dead_lettered`` / ``fallbacks``: failed or timed-out elements emitted that way;
    - ``late_ignored``: attempt results that arrived after their element was settled,
      its retry was scheduled, or the operator was snapshotted — dropped, never emitted.
    """

    in_flight: int = 0
    completed: int = 0
    timed_out: int = 0
    failed: int = 0
    retried: int = 0
    dead_lettered: int = 0
    fallbacks: int = 0
    late_ignored: int = 0
    reservoir_size: int = 4096
    _samples: list[float] = field(default_factory=list, repr=False)
    _seen: int = field(default=0, repr=False)
    _rng: random.Random = field(default_factory=lambda: random.Random(0), repr=False)
    _next: int = field(default=0, repr=False)  # the observation that replaces a sample
    _w: float = field(default=0.0, repr=False)

    def observe_latency(self, seconds: float) -> None:
        """Record one element's latency from admission to outcome."""
        self._seen += 1
        if len(self._samples) < self.reservoir_size:
            self._samples.append(seconds)
            if len(self._samples) == self.reservoir_size:
                self._w = math.exp(math.log(self._uniform()) / self.reservoir_size)
                self._skip()
        elif self._seen == self._next:
            self._samples[self._rng.randrange(self.reservoir_size)] = seconds
            self._w *= math.exp(math.log(self._uniform()) / self.reservoir_size)
            self._skip()

    def _uniform(self) -> float:
        """A uniform draw in (0, 1) (never 0, so its log is finite)."""
        return self._rng.random() or 5e-324

    def _skip(self) -> None:
        w = min(self._w, 1.0 - 2**-53)
        self._next = self._seen + int(math.log(self._uniform()) / math.log1p(-w)) + 1

    def percentile(self, q: float) -> float | None:
        """Latency at quantile ``q`` in ``[0, 1]`` (nearest rank), None before any sample."""
        if not 0.0 <= q <= 1.0:
            raise ValueError(f"quantile must be in [0, 1], got {q!r}")
        if not self._samples:
            return None
        ordered = sorted(self._samples)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    def as_dict(self) -> dict[str, Any]:
        """Plain-data view for logs and batch stats (latencies in seconds)."""
        return {
            "in_flight": self.in_flight,
            "completed": self.completed,
            "timed_out": self.timed_out,
            "failed": self.failed,
            "retried": self.retried,
            "dead_lettered": self.dead_lettered,
            "fallbacks": self.fallbacks,
            "late_ignored": self.late_ignored,
            "latency_p50_s": self.percentile(0.50),
            "latency_p95_s": self.percentile(0.95),
            "latency_p99_s": self.percentile(0.99),
        }
