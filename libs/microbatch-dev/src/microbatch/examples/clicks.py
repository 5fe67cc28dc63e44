"""Synthetic input for the clickstream example: users' click sessions, and malformed clicks.

The demo, the tests and the benches produce these to Kafka. Clicks are seeded, so a run
can be repeated, and start at :data:`T0` in simulated event time.
"""

from __future__ import annotations

import random
from typing import Any

MINUTE_MS = 60_000
T0 = 1_767_225_600_000  # 2026-01-01T00:00:00Z: simulated event time starts here

#: Clicks the pipeline cannot use (its dead letters): not JSON, no user, a bad timestamp.
MALFORMED = [b"{not json", b'{"page": "/home", "ts": 1}', b'{"user_id": "x", "ts": "soon"}']


def generate_clicks(users: int, hours: float, seed: int) -> list[dict[str, Any]]:
    """Sessions of clicks per user: clicks 1-10 min apart, sessions 35-120 min apart."""
    rng = random.Random(seed)
    pages = [f"/{p}" for p in ("home", "search", "item", "cart", "checkout", "help")]
    clicks = []
    for u in range(users):
        ts = T0 + rng.randrange(0, 60 * MINUTE_MS)
        while ts < T0 + hours * 60 * MINUTE_MS:
            for _ in range(rng.randint(1, 8)):
                clicks.append({"user_id": f"user-{u:04d}", "page": rng.choice(pages), "ts": ts})
                ts += rng.randint(1, 10) * MINUTE_MS
            ts += rng.randint(35, 120) * MINUTE_MS
    return sorted(clicks, key=lambda c: (c["ts"], c["user_id"]))
