"""An inner interval join's batch in one instance: at once on columns against key by key.

Orders ⋈ payments on the card, a payment within 2 s of its order: ``--orders`` orders and
``--payments`` payments over ``--cards`` cards and one minute, in one batch whose
watermark passes them all — every key leaves nothing behind, so
``IntervalJoin(select=fields(...))`` takes the batch at once on the sides' columns. The
reference is the same join with the output written as a function: the payloads decoded
into dicts and ``process`` per key, then its timers, as ``ProcessHarness`` runs them.
Engines alternate over ``--rounds``; both must give the same pairs in the same order.

A second part holds records across batches: a left join, payments up to 5 minutes after
their order, over three one-minute batches of ``--orders // 4`` orders and payments each,
every batch's watermark 2 s behind its newest time — so each batch pairs its records with
those the previous ones hold, reads them back from state and writes back the buckets
that stay. Both paths run in ``ProcessHarness`` (which encodes the column path's payloads
first and round-trips the state after each batch for both) and must give the same rows
and leave the same state.

It prints CPU seconds (median and best) per path and the ratio reference ÷ columns, with
the load.

    .venv/bin/python bench/bench_interval_join.py [--orders 200000] [--payments 200000]
"""

from __future__ import annotations

import argparse
import gc
import time
from typing import Any

import numpy as np
import pyarrow as pa
from benchlib import load, log, print_ratios

from microbatch.joins import IntervalJoin, fields
from microbatch.keygroups import KeyGroupRange, encode_key, key_group_of_bytes
from microbatch.runtime.envelope import decode_payloads
from microbatch.runtime.process import KeyedBatch
from microbatch.runtime.side_columns import RecordsOnUse, SideColumns
from microbatch.state.backend import KeyedStateBackend
from microbatch.state.codec_rows import encode_rows
from microbatch.testing import ProcessHarness, sided

MAXP = 128
BASE = 1_700_000_000_000
PICK = fields(left={"order": "id", "card": "card", "at": "ts"}, right={"payment": "id"})


def side(n: int, cards: int, seed: int) -> pa.Table:
    rng = np.random.default_rng(seed)
    return pa.table({
        "id": np.arange(n, dtype=np.int64) + seed * n,
        "card": rng.integers(0, cards, n),
        "ts": BASE + rng.integers(0, 60_000, n),
    })  # fmt: skip


class Batch:
    """Both sides' records in processing order: key by key (by the key's bytes), each
    key's orders then payments, each in source order."""

    def __init__(self, orders: pa.Table, payments: pa.Table) -> None:
        key = np.concatenate([orders.column("card").to_numpy(), payments.column("card").to_numpy()])
        sides = np.r_[np.zeros(orders.num_rows, np.int8), np.ones(payments.num_rows, np.int8)]
        cards = np.unique(key)  # keys in the order of their bytes, as stage 2 runs them
        by_bytes = sorted(range(len(cards)), key=lambda c: encode_key(int(cards[c])))
        rank = np.empty(len(cards), np.int64)
        rank[by_bytes] = np.arange(len(cards))
        order = np.lexsort((np.arange(len(key)), rank[np.searchsorted(cards, key)]))
        self.payloads = pa.concat_arrays([encode_rows(orders), encode_rows(payments)]).take(
            pa.array(order)
        )
        self.sides, key = sides[order], key[order]
        first = np.flatnonzero(np.r_[True, key[1:] != key[:-1]])
        self.bounds = np.append(first, len(key)).astype(np.int64)
        self.keys = key[first].tolist()
        self.key_bytes = [encode_key(k) for k in self.keys]
        self.key_groups = [key_group_of_bytes(kb, MAXP) for kb in self.key_bytes]


def on_columns(join: IntervalJoin, batch: Batch) -> tuple[float, list[Any]]:
    started = time.process_time()
    backend = KeyedStateBackend(MAXP, KeyGroupRange(0, MAXP - 1))
    records = RecordsOnUse(
        lambda i, j: decode_payloads(batch.payloads[i:j].to_pylist()), len(batch.sides)
    )  # decoded only if read: the join on columns reads its length
    keyed = KeyedBatch.on_backend(
        backend, batch.key_groups, batch.key_bytes, records, batch.bounds, batch.sides,
        BASE + 10**6, None, SideColumns(batch.payloads, batch.sides, {}),
    )  # fmt: skip
    handled = join.process_batch(keyed)
    assert handled is not None and handled.keys.all() and handled.columns is not None
    elapsed = time.process_time() - started
    return elapsed, handled.columns.to_pylist()


def by_key(join: IntervalJoin, batch: Batch) -> tuple[float, list[Any]]:
    started = time.process_time()
    records = decode_payloads(batch.payloads.to_pylist())
    lefts, rights = [], []
    for k, (i, j) in zip(batch.keys, zip(batch.bounds[:-1], batch.bounds[1:], strict=True),
                         strict=True):  # fmt: skip
        for s, record in zip(batch.sides[i:j].tolist(), records[i:j], strict=True):
            (rights if s else lefts).append((k, record))
    harness = ProcessHarness(join, max_parallelism=MAXP)
    out = harness.batch(sided(lefts, rights), watermark=BASE + 10**6)
    elapsed = time.process_time() - started
    return elapsed, list(out.emitted)


def held_batches(n: int, cards: int) -> list[tuple[list, list, int]]:
    """Three one-minute batches of ``n`` orders and ``n`` payments: ``(key, record)``
    pairs and the batch's watermark."""
    rng = np.random.default_rng(11)
    out = []
    for b in range(3):
        start = BASE + b * 60_000
        sides = []
        for side in range(2):
            ts = start + np.sort(rng.integers(0, 60_000, n)) - rng.integers(0, 2_000, n)
            card = rng.integers(0, cards, n)
            sides.append([
                (k, {"id": side * 10**9 + b * n + i, "card": k, "ts": t})
                for i, (k, t) in enumerate(zip(card.tolist(), ts.tolist(), strict=True))
            ])  # fmt: skip
        out.append((sides[0], sides[1], start + 58_000))
    return out


def across_batches(join: IntervalJoin, data: list[tuple[list, list, int]]) -> tuple[float, Any]:
    started = time.process_time()
    harness = ProcessHarness(join, max_parallelism=MAXP)
    results = [harness.batch(sided(o, p), watermark=w) for o, p, w in data]
    elapsed = time.process_time() - started
    rows = [sorted(map(str, r.emitted)) for r in results]
    return elapsed, (rows, [harness.state(k) for k in range(0, 2_000, 97)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--orders", type=int, default=200_000)
    parser.add_argument("--payments", type=int, default=200_000)
    parser.add_argument("--cards", type=int, default=50_000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    log(f"{args.orders:,} orders, {args.payments:,} payments, {args.cards:,} cards ({load()})")
    batch = Batch(side(args.orders, args.cards, 1), side(args.payments, args.cards, 2))
    paths = {
        "columns": (on_columns, IntervalJoin("ts", "ts", ("-2s", "2s"), select=PICK)),
        "key by key": (by_key, IntervalJoin("ts", "ts", ("-2s", "2s"),
                                            select=lambda o, p: PICK(o, p))),
    }  # fmt: skip
    times: dict[str, list[float]] = {}
    gc.disable()  # as in a stage-2 task (gcpause)
    for r in range(args.rounds):
        outs = {}
        for name in list(paths) if r % 2 == 0 else list(reversed(paths)):
            run, join = paths[name]
            t, outs[name] = run(join, batch)
            times.setdefault(name, []).append(t)
        if outs["columns"] != outs["key by key"]:
            raise SystemExit("the two paths gave different pairs")
        log(f"round {r + 1}: {len(outs['columns']):,} pairs, {load()}")
    held = held_batches(args.orders // 4, args.cards // 10)
    joins = {
        "held, columns": IntervalJoin("ts", "ts", (0, "5m"), how="left", select=PICK),
        "held, key by key": IntervalJoin(
            "ts", "ts", (0, "5m"), how="left", select=lambda o, p: PICK(o, p)
        ),
    }
    for r in range(args.rounds):
        outs = {}
        for name in list(joins) if r % 2 == 0 else list(reversed(joins)):
            t, outs[name] = across_batches(joins[name], held)
            times.setdefault(name, []).append(t)
        if outs["held, columns"] != outs["held, key by key"]:
            raise SystemExit("across batches, the two paths gave different rows or state")
        rows = sum(len(b) for b in outs["held, columns"][0])
        log(f"round {r + 1} across batches: {rows:,} rows, {load()}")
    gc.enable()
    print_ratios(times, [("columns", "key by key"), ("held, columns", "held, key by key")])
    log(f"{args.rounds} rounds; now {load()}")


if __name__ == "__main__":
    main()
