"""A temporal join over three batches in one instance: on columns against key by key.

Orders ⋈ the price of their product as of the order's time: ``--orders`` orders and
``--prices`` price versions over ``--products`` products, one minute per batch, up to
2 s out of order, each batch's watermark 2 s behind its newest time, so orders wait
across batches and versions come from state. ``TemporalJoin(select=fields(...))`` takes
the keys at once on columns; the reference is the same join with the output written as
a function: ``process`` per key and a timer per order time. Both run in
``ProcessHarness``, which hands the column path payloads it encodes first (stage 2 gets
them for free) and round-trips the state after each batch, for both. Engines alternate
over ``--rounds``; both must give the same rows and leave the same state.

It prints CPU seconds (median and best) per path for the three batches and the ratio
reference ÷ columns, with the load.

    .venv/bin/python bench/bench_temporal_join.py [--orders 200000] [--prices 50000]
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import time
from typing import Any

import numpy as np
from benchlib import load, log, print_ratios

from microbatch.joins import TemporalJoin, fields
from microbatch.testing import ProcessHarness, sided

BASE = 1_700_000_000_000
MINUTE = 60_000
PICK = fields(left=["id", "product", "qty", "ts"], right={"price": "price", "priced_at": "ts"})


def batches(orders: int, prices: int, products: int, n: int = 3) -> list[tuple[list, list, int]]:
    """``n`` batches of ``(orders, prices, watermark)``, as ``(key, record)`` pairs."""
    rng = np.random.default_rng(7)
    out = []
    for b in range(n):
        start = BASE + b * MINUTE
        o_ts = start + np.sort(rng.integers(0, MINUTE, orders)) - rng.integers(0, 2_000, orders)
        p_ts = start + np.sort(rng.integers(0, MINUTE, prices)) - rng.integers(0, 2_000, prices)
        o_key, p_key = rng.integers(0, products, orders), rng.integers(0, products, prices)
        price = np.round(rng.uniform(1, 100, prices), 2)
        lefts = [
            (k, {"id": b * orders + i, "product": k, "qty": i % 7 + 1, "ts": t})
            for i, (k, t) in enumerate(zip(o_key.tolist(), o_ts.tolist(), strict=True))
        ]
        rights = [
            (k, {"product": k, "price": p, "ts": t})
            for k, p, t in zip(p_key.tolist(), price.tolist(), p_ts.tolist(), strict=True)
        ]
        out.append((lefts, rights, start + MINUTE - 2_000))
    return out


def run(join: TemporalJoin, data: list[tuple[list, list, int]]) -> tuple[float, list, dict]:
    """CPU seconds for the batches; each batch's rows (sorted, as JSON) and the state
    after the last of some keys."""
    gc.collect()
    started = time.process_time()
    harness = ProcessHarness(join)
    results = [harness.batch(sided(lefts, rights), watermark=w) for lefts, rights, w in data]
    elapsed = time.process_time() - started
    rows = [sorted(json.dumps(r, sort_keys=True) for r in res.emitted) for res in results]
    state = {k: harness.state(k) for k in range(0, 1_000, 97)}
    return elapsed, rows, state


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--orders", type=int, default=200_000)
    parser.add_argument("--prices", type=int, default=50_000)
    parser.add_argument("--products", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    log(
        f"3 batches of {args.orders:,} orders and {args.prices:,} prices, "
        f"{args.products:,} products ({load()})"
    )
    data = batches(args.orders, args.prices, args.products)
    paths = {
        "columns": TemporalJoin("ts", "ts", "10m", select=PICK, how="left"),
        "key by key": TemporalJoin("ts", "ts", "10m", select=lambda o, p: PICK(o, p), how="left"),
    }
    times: dict[str, list[float]] = collections.defaultdict(list)
    gc.disable()  # as in a stage-2 task (gcpause)
    for r in range(args.rounds):
        outs: dict[str, Any] = {}
        for name in list(paths) if r % 2 == 0 else list(reversed(paths)):
            t, *outs[name] = run(paths[name], data)
            times[name].append(t)
        if outs["columns"] != outs["key by key"]:
            raise SystemExit("the two paths gave different rows or state")
        rows = sum(len(b) for b in outs["columns"][0])
        log(f"round {r + 1}: {rows:,} rows, {load()}")
    gc.enable()
    print_ratios(times, [("columns", "key by key")])  # CPU-s median (best), key by key ÷ columns
    log(f"{args.rounds} rounds; now {load()}")


if __name__ == "__main__":
    main()
