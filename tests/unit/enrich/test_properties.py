"""Property tests on the real operator: random latencies, failures and watermark positions.

Each example runs a real event loop with sub-millisecond-to-2-ms sleeps. Failing records
fail on every attempt, so the outcome of a record is deterministic and a run interrupted
by a snapshot must give exactly the results of an uninterrupted one.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from microbatch.enrich import (
    AsyncOperator,
    DeadLetter,
    Element,
    FixedDelay,
    PendingElement,
    Watermark,
)

MODES = ["ordered", "unordered", "ordered_per_key"]


@st.composite
def scenarios(draw) -> dict[str, Any]:
    n = draw(st.integers(1, 16))
    inputs: list[Any] = []
    ts = 0
    for i in range(n):
        if draw(st.booleans()) and draw(st.booleans()):
            ts += 1
            inputs.append(Watermark(ts))
        inputs.append(Element(i, ("t", 0, i), key=i % 3))
    return {
        "inputs": inputs,
        "latency": {i: draw(st.integers(0, 20)) / 10_000 for i in range(n)},  # 0–2 ms
        "failing": draw(st.sets(st.integers(0, n - 1), max_size=3)),
        "mode": draw(st.sampled_from(MODES)),
        "capacity": draw(st.integers(1, 6)),
    }


def operator(scenario: dict[str, Any]) -> AsyncOperator:
    latency, failing = scenario["latency"], scenario["failing"]

    async def invoke(record: int):
        await asyncio.sleep(latency[record])
        if record in failing:
            raise ConnectionError(f"refused {record}")
        return [record, record + 100] if record % 4 == 0 else record

    return AsyncOperator(
        invoke,
        mode=scenario["mode"],
        capacity=scenario["capacity"],
        timeout_s=None,
        retry=FixedDelay(0.0005, max_attempts=2),
        on_failure="dead_letter",
    )


async def feed(op: AsyncOperator, inputs: list[Any]) -> None:
    for item in inputs:
        if isinstance(item, Watermark):
            op.add_watermark(item.ts)
        else:
            await op.add(item)


def uninterrupted(scenario: dict[str, Any]) -> list[Any]:
    async def main():
        op = operator(scenario)
        await feed(op, scenario["inputs"])
        assert await op.finish()
        return op.take_ready()

    return asyncio.run(main())


def source(item: Any) -> int | None:
    """Input position an output belongs to (None for watermarks)."""
    return None if isinstance(item, Watermark) else item.coordinates[2]


def expected_per_input(scenario: dict[str, Any]) -> Counter:
    counts: Counter = Counter()
    for item in scenario["inputs"]:
        if isinstance(item, Element):
            i = item.record
            counts[i] = 1 if i in scenario["failing"] else (2 if i % 4 == 0 else 1)
    return counts


def check_contract(scenario: dict[str, Any], out: list[Any]) -> None:
    # every input emitted (or dead-lettered) exactly once, with all its results
    assert Counter(source(o) for o in out if source(o) is not None) == expected_per_input(scenario)
    for o in out:
        if isinstance(o, DeadLetter):
            assert o.record in scenario["failing"] and o.attempts == 2
    # watermark boundaries: nothing crosses a watermark
    order = [x.ts if isinstance(x, Watermark) else ("r", x.record) for x in scenario["inputs"]]
    position = {
        ("r", x.record) if isinstance(x, Element) else x.ts: k
        for k, x in enumerate(scenario["inputs"])
    }
    emitted_keys = [o.ts if isinstance(o, Watermark) else ("r", source(o)) for o in out]
    for a_index, a in enumerate(emitted_keys):
        for b in emitted_keys[a_index + 1 :]:
            if isinstance(a, int) or isinstance(b, int):  # a watermark is involved
                assert position[a] <= position[b]
    if scenario["mode"] == "ordered":
        firsts = list(dict.fromkeys(emitted_keys))
        assert firsts == order
    if scenario["mode"] == "ordered_per_key":
        for key in range(3):
            seen = [source(o) for o in out if not isinstance(o, Watermark) and source(o) % 3 == key]
            assert seen == sorted(seen)


@settings(max_examples=150, deadline=None)
@given(scenario=scenarios())
def test_output_respects_the_mode_and_every_input_is_emitted_once(scenario):
    check_contract(scenario, uninterrupted(scenario))


@settings(max_examples=150, deadline=None)
@given(
    scenario=scenarios(),
    cut=st.floats(0.0, 1.0),
    pause=st.integers(0, 30).map(lambda t: t / 10_000),
)
def test_snapshot_then_restore_gives_exactly_the_uninterrupted_results(scenario, cut, pause):
    inputs = scenario["inputs"]
    k = int(cut * len(inputs))

    async def first():
        op = operator(scenario)
        await feed(op, inputs[:k])
        await asyncio.sleep(pause)
        emitted = op.take_ready()
        pending = op.snapshot()
        emitted += op.take_ready()
        await op.aclose()
        return emitted, [PendingElement.from_bytes(p.to_bytes()) for p in pending]

    async def second(pending):
        op = operator(scenario)
        op.restore(pending)
        await feed(op, inputs[k:])
        assert await op.finish()
        return op.take_ready()

    before, pending = asyncio.run(first())
    after = asyncio.run(second(pending))
    whole = uninterrupted(scenario)

    combined = before + after
    assert Counter(combined) == Counter(whole)
    check_contract(scenario, combined)
    if scenario["mode"] == "ordered":
        assert combined == whole
