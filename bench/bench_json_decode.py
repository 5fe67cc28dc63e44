"""Declared JSON values into Arrow columns: the native fast path against pyarrow.json.

``JsonSchema.decode`` (``microbatch.runtime.schema``) turns a batch of Kafka values into
the declared columns. It takes two paths: the native one (``microbatch_native.decode_json``,
serde_json in Rust, each value parsed once straight into the columns) and, without the
extension or for the values it defers, ``pyarrow.json`` over newline-joined blocks with
Python deciding what Arrow refuses. This bench decodes the Nexmark events' values
(person, auction, bid: ``bench/nexmark``'s generator, 1M events by default, generated
once into ``.local/nexmark``) in batches of 50,000 (stage 1's read batch) with each path,
in one process, paths alternating over ``--rounds`` rounds, and prints per kind the CPU
microseconds per value (median and best), the ratio arrow ÷ native, and whether both
gave the same table (they must: the bench fails otherwise).

    .venv/bin/python bench/bench_json_decode.py [--events 1M] [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import pyarrow as pa
from benchlib import load, log
from nexmark import events as nexmark_events
from nexmark.run import HOME, count

from microbatch.runtime import schema as schema_module
from microbatch.runtime.schema import JsonSchema

BATCH = 50_000


def batches(path: Path) -> list[pa.Array]:
    """The file's lines as binary arrays of ``BATCH`` values."""
    lines = path.read_bytes().splitlines()
    return [pa.array(lines[i : i + BATCH], pa.binary()) for i in range(0, len(lines), BATCH)]


def decode_all(schema: JsonSchema, values: list[pa.Array], native: bool) -> tuple[float, pa.Table]:
    """CPU seconds to decode every batch, and the decoded rows."""
    decoder = schema_module._native_decoder if native else (lambda: None)
    saved = schema_module._native_decoder
    schema_module._native_decoder = decoder  # type: ignore[assignment]
    try:
        started = time.process_time()
        tables = [schema.decode(v) for v in values]
        cpu = time.process_time() - started
    finally:
        schema_module._native_decoder = saved  # type: ignore[assignment]
    if any(d.bad for d in tables):
        raise SystemExit(f"{sum(len(d.bad) for d in tables)} values did not decode")
    return cpu, pa.concat_tables(d.table for d in tables)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", default="1M", help="Nexmark events (e.g. 1M, 10M)")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    if schema_module._native_decoder() is None:
        raise SystemExit("microbatch_native is not installed: run `make venv`")
    events = nexmark_events.ensure_events(HOME, count(args.events), log)
    print(f"{args.events} Nexmark events, batches of {BATCH:,}, {args.rounds} rounds; {load()}")
    print(f"{'kind':<8} {'values':>10}  {'native µs/value':>16}  {'arrow µs/value':>15}  "
          f"{'arrow ÷ native':>14}  same")  # fmt: skip
    for kind in nexmark_events.KINDS:
        schema = JsonSchema(nexmark_events.fields(kind))
        values = batches(events.path(kind))
        n = sum(len(v) for v in values)
        runs: dict[bool, list[float]] = {True: [], False: []}
        tables: dict[bool, pa.Table] = {}
        for i in range(args.rounds):
            for native in (True, False) if i % 2 == 0 else (False, True):
                cpu, tables[native] = decode_all(schema, values, native)
                runs[native].append(cpu * 1e6 / n)
        same = tables[True].equals(tables[False])
        fast, slow = statistics.median(runs[True]), statistics.median(runs[False])
        print(
            f"{kind:<8} {n:>10,}  {fast:>7.2f} ({min(runs[True]):.2f})  "
            f"{slow:>7.2f} ({min(runs[False]):.2f})  {slow / fast:>14.2f}  "
            f"{'✓' if same else '✗'}",
            flush=True,
        )
        if not same:
            raise SystemExit(f"{kind}: the native path decoded other columns than pyarrow.json")
    print(f"median (best) CPU µs per value; {load()} at the end")


if __name__ == "__main__":
    main()
