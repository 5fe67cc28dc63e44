"""When to merge an instance's sorted runs: size tiers, newest first.

Every batch adds one small run per instance (the keys it changed), so without merging a
lookup would ask ever more runs. Merging rewrites bytes, so merging too eagerly costs
write amplification. The policy (RocksDB's "universal" compaction, Cassandra's size tiers):
look at the runs newest first and take the longest stretch in which each older run is no
bigger than ``(1 + slack) ×`` the runs already taken together; merge that stretch when it
has at least ``min_width`` runs. Runs of one size therefore merge ``min_width`` at a time
into one of ``min_width ×`` the size, each byte is rewritten about once per tier —
``log_{min_width}(state / batch)`` times over its life — and a lookup asks at most about
``(min_width - 1)`` runs per tier. ``max_runs`` bounds the count whatever the sizes.

Only a stretch that starts at the newest run and is contiguous in age is ever merged, so
"the newest entry of a key wins" holds across a merge (:func:`microbatch.state.engine.runs.merge`).
"""

from __future__ import annotations

from collections.abc import Sequence

MIN_WIDTH = 4
SLACK = 0.25
MAX_RUNS = 24


def runs_to_merge(
    sizes_newest_first: Sequence[int],
    *,
    min_width: int = MIN_WIDTH,
    slack: float = SLACK,
    max_runs: int = MAX_RUNS,
) -> int:
    """How many of the newest runs to merge into one now (0: none)."""
    if min_width < 2 or max_runs < min_width:
        raise ValueError(f"need 2 <= min_width <= max_runs: {min_width}, {max_runs}")
    taken, total = 0, 0
    for size in sizes_newest_first:
        if taken and size > (1 + slack) * total:
            break
        taken += 1
        total += size
    if taken >= min_width:
        return taken
    if len(sizes_newest_first) > max_runs:  # sizes too uneven to tier: bound the count
        return len(sizes_newest_first) - max_runs + 1
    return 0
