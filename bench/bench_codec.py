"""The state value codec: its MessagePack fast form (tag ``P``) against the tagged form
every release has written (``encode_canonical``, pure Python), in one run.

Each shape is a state value a stateful step keeps per record or per key: a Nexmark bid
and auction (dicts of ints and strings), a list of five bids (a join's buffered side), a
small list of ints (q4's auction summary) and one int (a counter). Per shape, each form
encodes and decodes every value, the forms alternating over ``--repeat`` rounds (default
3); the table shows µs per value (encode + decode), median and best, and the ratio of the
medians. Every decoded value must equal the original, type for type.

    .venv/bin/python bench/bench_codec.py [--values 200000] [--repeat 3]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable
from typing import Any

from benchlib import load, print_table

from microbatch.state.codec import decode_value, encode_canonical, encode_value


def shapes(n: int) -> dict[str, list[Any]]:
    rng = random.Random(1)

    def bid(i: int) -> dict[str, Any]:
        return {"auction": 1000 + i % 5000, "bidder": 2000 + i % 9000,
                "price": rng.randrange(10**6), "channel": f"channel-{i % 100}",
                "url": f"https://www.nexmark.com/item.htm?query={i}",
                "date_time": 1_700_000_000_000 + i, "extra": ""}  # fmt: skip

    def auction(i: int) -> dict[str, Any]:
        return {"id": i, "item_name": f"item-{i}", "description": "desc",
                "initial_bid": 100 + i, "reserve": 500 + i, "seller": i % 1000,
                "date_time": 1_700_000_000_000 + i, "expires": 1_700_000_010_000 + i,
                "category": 10 + i % 5}  # fmt: skip

    return {
        "bid (dict, 7 fields)": [bid(i) for i in range(n)],
        "auction (dict, 9 fields)": [auction(i) for i in range(n)],
        "5 bids (list of dicts)": [[bid(i + j) for j in range(5)] for i in range(n // 5)],
        "[date_time, expires, category]": [[1_700_000_000_000 + i, i, i % 5] for i in range(n)],
        "one int": list(range(n)),
    }


def seconds_per_value(encode: Callable[[Any], bytes], values: list[Any]) -> float:
    started = time.process_time()
    decoded = [decode_value(encode(v)) for v in values]
    spent = time.process_time() - started
    same_types = all(type(d) is type(v) for d, v in zip(decoded, values, strict=True))
    if decoded != values or not same_types:
        raise SystemExit(f"{encode.__name__}: a value did not come back as it was")
    return spent / len(values)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--values", type=int, default=200_000)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    forms = {"tagged (pure Python)": encode_canonical, "fast (msgpack)": encode_value}
    rows, loads = [], [load()]
    for shape, values in shapes(args.values).items():
        times: dict[str, list[float]] = {f: [] for f in forms}
        for r in range(args.repeat):
            for name in list(forms)[:: 1 if r % 2 == 0 else -1]:  # alternate who goes first
                times[name].append(seconds_per_value(forms[name], values) * 1e6)
        medians = {f: statistics.median(t) for f, t in times.items()}
        for name, t in times.items():
            rows.append((f"{shape}: {name}", f"{medians[name]:.2f} µs", f"best {min(t):.2f} µs"))
        ratio = medians["tagged (pure Python)"] / medians["fast (msgpack)"]
        rows.append((f"{shape}: ratio", f"{ratio:.1f}×", "tagged ÷ fast, medians"))
        loads.append(load())
    print_table(rows)
    print(f"\nload (1-min average) at start and after each shape: {' → '.join(loads)}")


if __name__ == "__main__":
    main()
