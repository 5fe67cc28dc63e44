"""Randomized two-sided streams for the join tests: events with out-of-order arrival and
some far-too-late ones, split into batches, with watermarks; and a runner that feeds them
through a join in :class:`~microbatch.testing.ProcessHarness`.

Every run is seeded: a failure reproduces with its seed."""

from __future__ import annotations

import collections
import dataclasses
import itertools
import json
import random
from collections.abc import Callable, Sequence
from typing import Any

from microbatch.runtime.process import KeyedProcessFunction
from microbatch.testing import BatchResult, ProcessHarness, sided

FLUSH = 10**12  # a watermark past every event: closes everything


@dataclasses.dataclass(frozen=True)
class Event:
    side: int
    key: str
    t: int
    id: str

    @property
    def record(self) -> dict[str, Any]:
        return {"id": self.id, "k": self.key, "ts": self.t}


def events(seed: int, n: int, keys: Sequence[str] = ("a", "b", "c"), span: int = 2_000):
    """``n`` events per side at random times in ``[0, span)``, ids ``L<i>`` / ``R<i>``."""
    rng = random.Random(seed)
    return [
        Event(side, rng.choice(keys), rng.randrange(span), f"{'LR'[side]}{i}")
        for side in (0, 1)
        for i in range(n)
    ]


def arrival_order(evs: list[Event], seed: int, disorder: int, late_share: float) -> list[Event]:
    """The events in arrival order: each arrives up to ``disorder`` ms after its time, a
    ``late_share`` of them up to 10x that (far behind the watermark by then)."""
    rng = random.Random(seed)
    delays = [rng.randrange(disorder * (10 if rng.random() < late_share else 1) + 1) for _ in evs]
    order = sorted(range(len(evs)), key=lambda i: (evs[i].t + delays[i], i))
    return [evs[i] for i in order]


def split(arrived: list[Event], seed: int, batches: int) -> list[list[Event]]:
    """Cut the arrival order into ``batches`` consecutive batches (some maybe empty)."""
    rng = random.Random(seed)
    cuts = sorted(rng.randrange(len(arrived) + 1) for _ in range(batches - 1))
    bounds = [0, *cuts, len(arrived)]
    return [arrived[a:b] for a, b in itertools.pairwise(bounds)]


def lagging_watermarks(batches: list[list[Event]], lateness: int) -> list[int | None]:
    """After each batch: the largest event time so far minus ``lateness`` (Spark's rule)."""
    out, top = [], None
    for batch in batches:
        for e in batch:
            top = e.t if top is None else max(top, e.t)
        out.append(None if top is None else top - lateness)
    return out


def safe_watermarks(batches: list[list[Event]]) -> list[int]:
    """Watermarks no record is ever behind: after each batch, the earliest time still to
    come (the last batch's: :data:`FLUSH`)."""
    out = []
    for j in range(len(batches)):
        later = [e.t for b in batches[j + 1 :] for e in b]
        out.append(min(later) if later else FLUSH)
    return out


def starts(watermarks: list[int | None]) -> list[int | None]:
    """The watermark each batch starts with."""
    return [None, *watermarks[:-1]]


def run(
    fn: KeyedProcessFunction,
    batches: list[list[Event]],
    watermarks: list[int | None],
    *,
    parallelism: Callable[[int], int] | None = None,
    shuffle: int | None = None,
) -> tuple[list[BatchResult], ProcessHarness]:
    """Each batch through ``fn`` in a harness (``parallelism(j)``: the instances of batch
    ``j``; ``shuffle``: seed to permute each batch's records first); the results and the
    harness after the last batch."""
    harness = ProcessHarness(fn, max_parallelism=16)
    rng = random.Random(shuffle)
    out = []
    for j, (batch, w) in enumerate(zip(batches, watermarks, strict=True)):
        if parallelism is not None:
            harness.rescale(parallelism(j))
        batch = list(batch)
        if shuffle is not None:
            rng.shuffle(batch)
        lefts = [(e.key, e.record) for e in batch if e.side == 0]
        rights = [(e.key, e.record) for e in batch if e.side == 1]
        out.append(harness.batch(sided(lefts, rights), watermark=w))
    return out, harness


def pair_ids(left: Any, right: Any) -> tuple[str | None, str | None]:
    """A ``select`` that keeps only the ids."""
    return (left["id"] if left else None, right["id"] if right else None)


def emitted(results: list[BatchResult]) -> list[collections.Counter]:
    return [collections.Counter(r.emitted) for r in results]


def dead(results: list[BatchResult]) -> list[collections.Counter]:
    return [
        collections.Counter((d.reason, d.record["id"]) for d in r.dead_letters) for r in results
    ]


@dataclasses.dataclass
class AgainstDicts:
    """What :func:`on_columns_against_dicts` saw over all batches."""

    keys_as_columns: int = 0
    late: int = 0
    timers_fired: int = 0
    timers_fired_by_dicts: int = 0


def on_columns_against_dicts(
    make: Callable[[Any], KeyedProcessFunction], pick: Any, seed: int, drains: bool = True
) -> AgainstDicts:
    """The join ``make(select)`` with ``select=pick`` (``fields(...)``: on columns) and
    with the same select as a function (record by record), each in a harness, over the
    same out-of-order batches with late records and rescales 2→3→1, then a flush. After
    every batch, each key's output (a row's ``k``, else ``rk``; in order), the dead
    letters and each key's state and timers must be equal; with ``drains``, the flush
    leaves no state."""
    arrived = arrival_order(events(seed, 80, keys="abcdefgh"), seed, disorder=100, late_share=0.2)
    batches = split(arrived, seed, 10)
    watermarks = lagging_watermarks(batches, lateness=50)
    on_columns, by_dicts = (
        ProcessHarness(make(select), 16) for select in (pick, lambda a, b: pick(a, b))
    )
    seen = AgainstDicts()
    for j, (batch, watermark) in enumerate([*zip(batches, watermarks, strict=True),
                                           ([], FLUSH)]):  # fmt: skip
        records = sided(
            [(e.key, e.record) for e in batch if e.side == 0],
            [(e.key, e.record) for e in batch if e.side == 1],
        )
        got, want = (h.batch(records, watermark=watermark) for h in (on_columns, by_dicts))
        for harness in (on_columns, by_dicts):
            harness.rescale((2, 3, 1)[j % 3])
        assert _by_key(got.emitted) == _by_key(want.emitted), f"batch {j}"
        assert got.dead_letters == want.dead_letters, f"batch {j}"
        for key in "abcdefgh":
            assert on_columns.state(key) == by_dicts.state(key), f"batch {j}, key {key}"
        seen.keys_as_columns += got.keys_as_columns
        seen.late += sum(d.reason == "late_join" for d in want.dead_letters)
        seen.timers_fired += got.timers_fired
        seen.timers_fired_by_dicts += want.timers_fired
    assert seen.late, "the data should have late records"
    assert on_columns.keys_with_state() == [] or not drains
    return seen


def _by_key(emitted: tuple[Any, ...]) -> dict[str, list[str]]:
    """Output per key (a row's ``k``, or ``rk`` for a right record alone), in order."""
    out: dict[str, list[str]] = {}
    for row in emitted:
        out.setdefault(row["k"] or row.get("rk"), []).append(json.dumps(row, sort_keys=True))
    return dict(sorted(out.items()))
