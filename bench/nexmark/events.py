"""Nexmark events: the real generator, events on disk once per size, topics in Kafka.

- :func:`ensure_generator` builds the Rust crate ``nexmark`` (crates.io, the generator
  RisingWave and Arroyo use; a port of the Java/Beam one) with its command-line tool, once,
  into ``.local/nexmark/bin`` (``cargo install --locked``, version pinned).
- :func:`ensure_events` runs it once per event count — ``nexmark -n N --no-wait``, all
  three kinds in the generator's own order (1 person, 3 auctions, 46 bids in every 50
  events; 10,000 events per second of event time, so 1M events span 100 s) — and splits
  its output into ``person.jsonl``, ``auction.jsonl`` and ``bid.jsonl`` under
  ``.local/nexmark/events-<N>/``: each line one event's own JSON object
  (``{"auction": 1000, "bidder": 1001, "price": 73134520, ..., "date_time": <epoch ms>}``).
  The generator stamps its first event with the wall clock, so the three kinds must come
  from one run; a size already generated is reused as it is.
- :func:`produce` writes the files into three topics with Spark's batch Kafka writer (the
  JVM producer; no Python per record), each file read as one partition so every topic
  partition gets its events in generator order, round-robin over ``partitions``.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

CRATE, VERSION = "nexmark", "0.2.0"
KINDS = ("person", "auction", "bid")
#: The generator's JSON wraps each event: ``{"Bid": {...}}``.
_WRAPPER = {'{"Person":': "person", '{"Auction":': "auction", '{"Bid":': "bid"}

#: The events' fields (the crate's serde names), as Spark DDL; ``date_time`` and
#: ``expires`` are epoch milliseconds.
SPARK_DDL = {
    "person": "id LONG, name STRING, email_address STRING, credit_card STRING, city STRING, "
    "state STRING, date_time LONG, extra STRING",
    "auction": "id LONG, item_name STRING, description STRING, initial_bid LONG, reserve LONG, "
    "date_time LONG, expires LONG, seller LONG, category LONG, extra STRING",
    "bid": "auction LONG, bidder LONG, price LONG, channel STRING, url STRING, date_time LONG, "
    "extra STRING",
}


def fields(kind: str) -> dict[str, str]:
    """``{name: type}`` of one kind's fields (``long`` / ``string``), from :data:`SPARK_DDL`."""
    pairs = (f.split() for f in SPARK_DDL[kind].split(","))
    return {name: type_.lower() for name, type_ in pairs}


@dataclasses.dataclass(frozen=True)
class Events:
    """One generated set: its folder, how many events of each kind, and each kind's first
    and last event time (epoch ms; the generator emits in time order)."""

    root: Path
    events: int
    counts: dict[str, int]
    first_ms: dict[str, int]
    last_ms: dict[str, int]

    def path(self, kind: str) -> Path:
        return self.root / f"{kind}.jsonl"

    def to_json(self) -> dict[str, Any]:
        return {
            "events": self.events,
            "counts": self.counts,
            "first_ms": self.first_ms,
            "last_ms": self.last_ms,
            "generator": f"{CRATE} {VERSION}",
        }

    @classmethod
    def from_json(cls, root: Path, data: dict[str, Any]) -> Events:
        return cls(root, data["events"], data["counts"], data["first_ms"], data["last_ms"])


def generator_path(home: Path) -> Path:
    return home / "bin" / CRATE


def ensure_generator(home: Path, log: Any = print) -> Path:
    """The generator's binary, built once by ``cargo install`` into ``home`` (idempotent:
    a binary of the pinned version is reused)."""
    binary, stamp = generator_path(home), home / ".version"
    if binary.exists() and stamp.exists() and stamp.read_text() == VERSION:
        return binary
    cargo = shutil.which("cargo") or str(Path.home() / ".cargo" / "bin" / "cargo")
    if not Path(cargo).exists():
        raise SystemExit(
            "the Nexmark generator is the Rust crate `nexmark` and needs cargo: install Rust "
            "(https://rustup.rs), then run the bench again"
        )
    log(f"building the Nexmark generator ({CRATE} {VERSION} from crates.io) into {home} ...")
    command = [cargo, "install", CRATE, "--version", VERSION, "--features", "bin", "--locked"]
    done = subprocess.run([*command, "--root", str(home)], capture_output=True, text=True)
    if done.returncode != 0 or not binary.exists():
        raise SystemExit(
            f"`{' '.join(command)}` failed ({done.returncode}):\n{done.stderr[-2000:]}"
        )
    stamp.write_text(VERSION)
    return binary


def ensure_events(home: Path, n: int, log: Any = print) -> Events:
    """``n`` events from the generator, split by kind under ``home/events-<n>`` (reused when
    already there)."""
    root = home / f"events-{n}"
    meta = root / "events.json"
    if meta.exists():
        return Events.from_json(root, json.loads(meta.read_text()))
    binary = ensure_generator(home, log)
    partial = home / f"events-{n}.partial"
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    log(f"generating {n:,} Nexmark events into {root} ...")
    started = time.monotonic()
    counts = dict.fromkeys(KINDS, 0)
    first: dict[str, str] = {}
    last: dict[str, str] = {}
    outs = {k: (partial / f"{k}.jsonl").open("w") for k in KINDS}
    with subprocess.Popen(
        [str(binary), "--number", str(n), "--no-wait"], stdout=subprocess.PIPE, text=True
    ) as gen:
        assert gen.stdout is not None
        for line in gen.stdout:
            head, _, body = line.partition(":")
            kind = _WRAPPER[head + ":"]
            event = body[:-2]  # drop the wrapper's closing brace and the newline
            outs[kind].write(event + "\n")
            counts[kind] += 1
            first.setdefault(kind, event)
            last[kind] = event
    for f in outs.values():
        f.close()
    if gen.returncode != 0 or sum(counts.values()) != n:
        raise SystemExit(
            f"the generator exited {gen.returncode} after {sum(counts.values())} of {n}"
        )
    first_ms = {k: json.loads(e)["date_time"] for k, e in first.items()}
    last_ms = {k: json.loads(e)["date_time"] for k, e in last.items()}
    events = Events(root, n, counts, first_ms, last_ms)
    (partial / "events.json").write_text(json.dumps(events.to_json(), indent=1))
    partial.rename(root)
    log(f"  {counts} in {time.monotonic() - started:.1f} s")
    return events


def produce(spark: Any, bootstrap: str, events: Events, topics: dict[str, str], partitions: int,
            log: Any = print) -> None:  # fmt: skip
    """Each kind's file into its topic (``topics[kind]``, created with ``partitions``
    partitions), through Spark's Kafka writer: one Spark partition per file, so records
    land round-robin in the file's order."""
    from pyspark.sql import functions as F

    from microbatch.localstack.topics import create_topics

    create_topics(bootstrap, dict.fromkeys(topics.values(), partitions))
    for kind, topic in topics.items():
        started = time.monotonic()
        lines = spark.read.text(str(events.path(kind))).coalesce(1)
        partition = (F.monotonically_increasing_id() % partitions).cast("int").alias("partition")
        (
            lines.select("value", partition)
            .write.format("kafka")
            .option("kafka.bootstrap.servers", bootstrap)
            .option("topic", topic)
            .option("kafka.linger.ms", "20")
            .option("kafka.batch.size", str(1 << 20))
            .option("kafka.acks", "1")
            .save()
        )  # fmt: skip
        n, elapsed = events.counts[kind], time.monotonic() - started
        log(f"  {topic}: {n:,} records in {elapsed:.1f} s ({n / elapsed:,.0f}/s)")
