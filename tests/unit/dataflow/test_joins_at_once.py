"""Joins take their keys at once (``process_batch``): a window join the keys whose
windows close in their own batch, a table join every key. Through stage 1 and stage 2 of
a dataflow (Nexmark q8 in miniature, a hopping join of two sources, a left table join
with deletes), every sink batch by batch and every dead letter equal what ``process``
key by key gives, through a crash, a replay and a rescale."""

from __future__ import annotations

import collections
import dataclasses
import datetime as dt
import json
import random
from pathlib import Path

import pytest

from microbatch import windows
from microbatch.checkpoint import Layout, latest_manifest
from microbatch.dataflow import Dataflow
from microbatch.joins import TableJoin, WindowJoin
from microbatch.kafka import TopicPartition
from microbatch.runtime import (
    BatchOptions,
    BatchResult,
    BatchRunner,
    DeadLetterSink,
    EventTime,
    InjectedCrash,
    KafkaSource,
    KeyedProcessFunction,
    ParquetSink,
)
from microbatch.runtime.records import BatchRecord
from microbatch.settings import Settings
from microbatch.sinks import read_parquet_sink
from microbatch.storage import open_store
from tests.unit.runtime.test_protocol import Log
from tests.unit.runtime.test_window_pre_aggregation import PerPartition, dead_letters

SEC = 1_000
PEOPLE = [f"p{i:03}" for i in range(500)]


def produce(log: Log, seed: int, start: int, n: int) -> None:
    """People, and auctions of people just seen, over two partitions each, up to 3 s
    out of order (most keys in one batch only: their windows close in it); a
    person now and then with an ISO-8601 time (read per record), without an id (a dead
    letter), or far behind the watermark (late for every window: ``late_join``)."""
    rng = random.Random(seed)
    recent = [rng.choice(PEOPLE) for _ in range(5)]
    for i in range(n):
        ts = start + i * 150 - rng.randrange(3 * SEC)
        person: dict = {"id": rng.choice(PEOPLE), "name": f"n{i}", "ts": ts}
        recent = [*recent[1:], person["id"]]
        roll = rng.random()
        if roll < 0.03:
            person["ts"] = dt.datetime.fromtimestamp(ts / 1000, dt.UTC).isoformat()
        elif roll < 0.05:
            del person["id"]
        elif roll < 0.08 and start:
            person["ts"] = start - 60 * SEC
        elif roll < 0.12:
            person["deleted"] = True
        auction = {"seller": rng.choice(recent), "ts": start + i * 150 - rng.randrange(3 * SEC)}
        log.values[TopicPartition("people", i % 2)].append(json.dumps(person).encode())
        log.values[TopicPartition("auctions", (i // 3) % 2)].append(json.dumps(auction).encode())


BATCHES = [(10 * SEC, 150), (40 * SEC, 150), (70 * SEC, 150), (100 * SEC, 150)]


def new_user(person: dict, seller: dict) -> dict:
    return {"id": person["id"], "name": person["name"], "sold": seller["count"]}


def sold_by(person: dict, auction: dict) -> dict:
    return {"id": person["id"], "name": person["name"], "auction_ts": auction["ts"]}


def seller_now(auction: dict, person: dict | None) -> dict:
    return {"seller": auction["seller"], "ts": auction["ts"], "name": (person or {}).get("name")}


def two_topics(name: str, topics: tuple[str, str], lateness_s: int, tmp_path: Path
               ) -> tuple[Log, Dataflow]:  # fmt: skip
    """A stand-in log of ``topics`` (two partitions each) and a dataflow over it at
    parallelism 2 of 8, whose dead letters never fail a batch."""
    log = Log(partitions=2)
    log.values = {TopicPartition(t, p): [] for t in topics for p in range(2)}
    log.start = dict.fromkeys(log.values, 0)
    flow = Dataflow(
        name,
        checkpoints=str(tmp_path / "checkpoints"),
        event_time=EventTime("ts", allowed_lateness_s=lateness_s, idle_timeout_s=None),
        dead_letters=DeadLetterSink(path=str(tmp_path / "dead"), max_ratio=1.0),
        max_parallelism=8,
        parallelism=2,
    )
    return log, flow


def crash_then_rescale(runner: BatchRunner, n: int) -> BatchResult:
    """Batch ``n`` of a run: the second crashes inside stage 2 and is replayed, the third
    on runs at parallelism 3."""
    if n == 1:
        with pytest.raises(InjectedCrash):
            runner.run(BatchOptions(crash_at="after_state_files", run_id="r"))
    return runner.run(BatchOptions(run_id="r", parallelism=3 if n >= 2 else None))


def run(tmp_path: Path) -> tuple[dict[str, list], list, collections.Counter]:
    log, flow = two_topics("new-users", ("people", "auctions"), 2, tmp_path)
    people = flow.source(KafkaSource(topics=("people",)))
    auctions = flow.source(KafkaSource(topics=("auctions",)))
    sellers = auctions.key_by("seller").window(
        windows.tumbling("10s").count().final(), uid="sellers"
    )
    q8 = WindowJoin("ts", "window_start", "10s", select=new_user)
    people.key_by("id").join(sellers.key_by("key"), q8, uid="new-users").to(
        ParquetSink("new_users", str(tmp_path / "new_users"))
    )
    both = WindowJoin("ts", "ts", windows.hopping("6s", every="2s"), select=sold_by)
    people.key_by("id").join(auctions.key_by("seller"), both, uid="pairs").to(
        ParquetSink("pairs", str(tmp_path / "pairs"))
    )
    table = TableJoin("left", select=seller_now, tombstone=lambda p: p.get("deleted", False))
    auctions.key_by("seller").join(people.key_by("id"), table, uid="sellers-now").to(
        ParquetSink("sellers_now", str(tmp_path / "sellers_now"))
    )
    pipeline = flow.build()
    settings = dataclasses.replace(Settings.from_env(), spark_master="local[1]")
    out: dict[str, list] = collections.defaultdict(list)
    for n, (start, count) in enumerate(BATCHES):
        produce(log, seed=n, start=start, n=count)
        runner = BatchRunner(None, pipeline, settings, executor=PerPartition(log), broker=log)
        result = crash_then_rescale(runner, n)
        assert result.replayed == (n == 1)
        for sink in ("new_users", "pairs", "sellers_now"):
            rows = read_parquet_sink(str(tmp_path / sink)).to_pylist()
            out[sink].append(sorted(json.dumps(r, sort_keys=True) for r in rows))
    manifest = latest_manifest(open_store(pipeline.checkpoints, settings), Layout())
    stats = BatchRecord.of(manifest).stats
    counters: collections.Counter = collections.Counter()
    for instance in stats.instances if stats else ():
        counters.update(instance.counters)
    return dict(out), dead_letters(tmp_path / "dead"), counters


def test_keys_joined_at_once_equal_key_by_key_through_a_crash_and_a_rescale(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    got_out, got_dead, got_counts = run(tmp_path / "at-once")
    with monkeypatch.context() as m:
        m.setattr(WindowJoin, "process_batch", KeyedProcessFunction.process_batch)
        m.setattr(TableJoin, "process_batch", KeyedProcessFunction.process_batch)
        want_out, want_dead, want_counts = run(tmp_path / "by-key")

    batched = {k: v for k, v in got_counts.items() if k.endswith("keys_batched")}
    assert min(batched.values()) > 20 and len(batched) == 3, f"keys at once: {batched}"
    assert not any(k.endswith("keys_batched") for k in want_counts)
    assert all(len(want_out[sink][-1]) > 50 for sink in want_out)
    named = [json.loads(r)["name"] for r in want_out["sellers_now"][-1]]
    assert None in named and len(set(named)) > 50
    reasons = {d[0] for d in want_dead}
    assert {"late_join", "missing_key"} <= reasons, reasons
    assert got_out == want_out
    assert got_dead == want_dead
