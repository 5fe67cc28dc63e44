"""A table join's batch in one stage-2 instance: on Arrow columns against record by record.

Nexmark q3's join level, in process: ``--people`` table rows (id, name, city, state) and
``--auctions`` stream rows (id, seller; a third of the sellers have no row) reach the
instance as payloads, key by key, the table's first in each key, as stage 2 sees them.
Each round runs two batches on a fresh state backend — the first with both sides (its
values written to state), the second with new auctions only (their values read back from
state) — once with ``TableJoin(select=fields(...))``, which joins on the sides' columns,
and once with the same output written as a ``select`` function, which decodes every
record into a dict; engines alternate. Each path ends with its output as one Arrow table
(what a sink stages). Both must give the same rows and the same stored bytes.

It prints CPU seconds (median and best over ``--rounds``) per path and batch, and the
ratio records ÷ columns, with the load.

    .venv/bin/python bench/bench_table_join.py [--people 100000] [--auctions 400000] [--rounds 5]
"""

from __future__ import annotations

import argparse
import gc
import time
from typing import Any

import numpy as np
import pyarrow as pa
from benchlib import load, log, print_ratios

from microbatch.joins import TableJoin, fields
from microbatch.keygroups import KeyGroupRange, encode_key, key_group_of_bytes
from microbatch.runtime.columnar import PayloadRuns
from microbatch.runtime.envelope import decode_payloads
from microbatch.runtime.process import KeyedBatch
from microbatch.runtime.side_columns import RecordsOnUse, SideColumns
from microbatch.state.backend import KeyedStateBackend
from microbatch.state.codec_rows import encode_rows

MAXP = 128
PICK = fields(left=["id"], right=["name", "city", "state"])
STATES = ("or", "id", "ca", "wa")
PEOPLE = pa.schema([("id", pa.int64()), ("name", pa.string()), ("city", pa.string()),
                   ("state", pa.string())])  # fmt: skip
AUCTIONS = pa.schema([("id", pa.int64()), ("seller", pa.int64())])


def by_dicts(a: dict[str, Any], p: dict[str, Any] | None) -> dict[str, Any]:
    return {"id": a["id"], "name": p["name"], "city": p["city"], "state": p["state"]}  # type: ignore[index]


def people(n: int) -> pa.Table:
    ids = np.arange(n, dtype=np.int64)
    return pa.table({
        "id": ids,
        "name": [f"person {i}" for i in range(n)],
        "city": [f"city {i % 1000}" for i in range(n)],
        "state": [STATES[i % 4] for i in range(n)],
    }, schema=PEOPLE)  # fmt: skip


def auctions(n: int, people: int, seed: int) -> pa.Table:
    rng = np.random.default_rng(seed)
    return pa.table({
        "id": np.arange(n, dtype=np.int64) + seed * n,
        "seller": rng.integers(0, people * 3 // 2, n),
    }, schema=AUCTIONS)  # fmt: skip


class Batch:
    """One instance's records of a batch in processing order (key by key, the table's
    first), with what stage 2 hands ``process_batch``."""

    def __init__(self, stream: pa.Table, table: pa.Table | None) -> None:
        keys = [stream.column("seller").to_numpy()]
        sides = [np.zeros(stream.num_rows, dtype=np.int8)]
        payloads = [encode_rows(stream)]
        if table is not None:
            keys.append(table.column("id").to_numpy())
            sides.append(np.ones(table.num_rows, dtype=np.int8))
            payloads.append(encode_rows(table))
        key, side = np.concatenate(keys), np.concatenate(sides)
        order = np.lexsort((-side, key))
        self.payloads = pa.concat_arrays(payloads).take(pa.array(order))
        self.sides, key = side[order], key[order]
        first = np.flatnonzero(np.r_[True, key[1:] != key[:-1]])
        self.bounds = np.append(first, len(key)).astype(np.int64)
        self.key_bytes = [encode_key(int(k)) for k in key[first]]
        self.key_groups = [key_group_of_bytes(kb, MAXP) for kb in self.key_bytes]

    def keyed(self, backend: KeyedStateBackend) -> KeyedBatch:
        records = RecordsOnUse(PayloadRuns(self.payloads, decode_payloads), len(self.payloads))
        schemas = {0: AUCTIONS, 1: PEOPLE}
        return KeyedBatch.on_backend(
            backend, self.key_groups, self.key_bytes, records, self.bounds, self.sides,
            None, None, SideColumns(self.payloads, self.sides, schemas),
        )  # fmt: skip


def run(join: TableJoin, batch: Batch, backend: KeyedStateBackend) -> tuple[float, pa.Table]:
    """CPU seconds of the join and of its output becoming one table."""
    started = time.process_time()
    handled = join.process_batch(batch.keyed(backend))
    assert handled is not None and handled.keys.all()
    if handled.columns is not None:
        out = handled.columns
    else:
        out = pa.Table.from_pylist([r for k in sorted(handled.emitted) for r in handled.emitted[k]])
    return time.process_time() - started, out


def stored(backend: KeyedStateBackend) -> dict[bytes, bytes]:
    return {kb: entry[0] for kg in range(MAXP)
            for kb, entry in (backend.table(kg, "table") or {}).items()}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--people", type=int, default=100_000)
    parser.add_argument("--auctions", type=int, default=400_000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    log(f"{args.people:,} people, {args.auctions:,} auctions a batch ({load()})")
    first = Batch(auctions(args.auctions, args.people, 1), people(args.people))
    second = Batch(auctions(args.auctions, args.people, 2), None)
    joins = {"columns": TableJoin(select=PICK), "records": TableJoin(select=by_dicts)}
    times: dict[str, list[float]] = {}
    gc.disable()  # as in a stage-2 task (gcpause)
    for r in range(args.rounds):
        outs, states = {}, {}
        for name in list(joins) if r % 2 == 0 else list(reversed(joins)):
            backend = KeyedStateBackend(MAXP, KeyGroupRange(0, MAXP - 1))
            t1, out1 = run(joins[name], first, backend)
            t2, out2 = run(joins[name], second, backend)
            times.setdefault(f"{name}: with table rows", []).append(t1)
            times.setdefault(f"{name}: values from state", []).append(t2)
            outs[name] = [sorted(out.to_pylist(), key=lambda x: x["id"]) for out in (out1, out2)]
            states[name] = stored(backend)
        if outs["columns"] != outs["records"] or states["columns"] != states["records"]:
            raise SystemExit("the two paths gave different rows or state")
        rows = sum(len(o) for o in outs["columns"])
        log(f"round {r + 1}: {rows:,} rows joined, {len(states['columns']):,} values, {load()}")
    gc.enable()
    batches = ("with table rows", "values from state")
    # path, CPU-s median (best), records ÷ columns
    print_ratios(times, [(f"columns: {b}", f"records: {b}") for b in batches])
    log(f"{args.rounds} rounds; now {load()}")


if __name__ == "__main__":
    main()
