"""A windowed pipeline through the whole batch protocol (stand-in broker and executor,
real stage 1 and stage 2): windows emitted once when the watermark closes them, open
windows kept across batches, late records in the dead letters."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from microbatch import windows
from microbatch.errors import ConfigError
from microbatch.kafka import TopicPartition
from microbatch.runtime import (
    BatchRunner,
    DeadLetterSink,
    EventTime,
    KafkaSource,
    ParquetSink,
    Pipeline,
)
from microbatch.settings import Settings
from microbatch.sinks import read_parquet_sink
from tests.unit.runtime.test_protocol import InProcess, Log

MIN = 60_000


def produce(log: Log, *events: tuple[str, int, int]) -> None:
    values = log.values[TopicPartition("clicks", 0)]
    values.extend(json.dumps({"user": u, "ts": ts, "amount": a}).encode() for u, ts, a in events)


def pipeline(tmp_path: Path, process) -> Pipeline:
    return Pipeline(
        name="windows",
        source=KafkaSource(topics=("clicks",)),
        key_by="user",
        process=process,
        event_time=EventTime("ts", idle_timeout_s=None),
        sinks=[ParquetSink("out", str(tmp_path / "out"))],
        dead_letters=DeadLetterSink(path=str(tmp_path / "dead"), max_ratio=1.0),
        checkpoints=str(tmp_path / "checkpoints"),
        max_parallelism=8,
        parallelism=2,
    )


def windows_out(tmp_path: Path) -> list[tuple]:
    rows = read_parquet_sink(str(tmp_path / "out")).to_pylist()
    cols = ("key", "window_start", "window_end", "count", "sum_amount")
    return sorted(tuple(r[c] for c in cols) for r in rows)


def run(p: Pipeline, log: Log) -> None:
    settings = dataclasses.replace(Settings.from_env(), spark_master="local[1]")
    BatchRunner(None, p, settings, executor=InProcess(log), broker=log).run()


def test_tumbling_windows_close_with_the_watermark_across_batches(tmp_path: Path) -> None:
    log = Log(partitions=1)
    p = pipeline(tmp_path, windows.tumbling("1m").count().sum("amount").final())
    produce(
        log,
        ("a", 1_000, 1),
        ("b", 2_000, 2),
        ("a", 61_000, 3),
        ("a", 130_000, 4),
        ("b", 170_000, 5),
    )
    run(p, log)  # watermark 170 s: [0, 60) and [60, 120) close

    first = sorted(
        read_parquet_sink(str(tmp_path / "out")).to_pylist(),
        key=lambda r: (r["key"], r["window_start"]),
    )
    assert [
        (r["key"], r["window_start"], r["window_end"], r["count"], r["sum_amount"]) for r in first
    ] == [
        ("a", 0, MIN, 1, 1),
        ("a", MIN, 2 * MIN, 1, 3),
        ("b", 0, MIN, 1, 2),
    ]

    produce(log, ("a", 30_000, 100), ("a", 175_000, 6), ("b", 250_000, 7))  # 30 s is late
    run(p, log)  # watermark 250 s: [120, 180) closes for both keys

    rows = read_parquet_sink(str(tmp_path / "out")).to_pylist()
    later = sorted(
        (r["key"], r["window_start"], r["count"], r["sum_amount"])
        for r in rows
        if r["window_start"] == 2 * MIN
    )
    assert later == [("a", 2 * MIN, 2, 10), ("b", 2 * MIN, 1, 5)]
    assert len(rows) == 5  # each closed window exactly once; [240, 300) of b still open
    dead = read_parquet_sink(str(tmp_path / "dead")).to_pylist()
    assert [(d["reason"], d["offset"]) for d in dead] == [("late_window", 5)]


def test_a_record_behind_the_watermark_counts_while_its_window_is_open(tmp_path: Path) -> None:
    log = Log(partitions=1)
    p = pipeline(tmp_path, windows.tumbling("1m").count().sum("amount").final())
    produce(log, ("a", 10_000, 1), ("a", 70_000, 2))
    run(p, log)  # watermark 70 s: [0, 60) closes
    produce(log, ("a", 65_000, 3), ("a", 50_000, 4), ("a", 130_000, 5))
    run(p, log)  # 65 s is behind 70 s, but [60, 120) is open; 50 s is in a closed window

    assert windows_out(tmp_path) == [("a", 0, MIN, 1, 1), ("a", MIN, 2 * MIN, 2, 5)]
    dead = read_parquet_sink(str(tmp_path / "dead")).to_pylist()
    assert [(d["reason"], d["offset"]) for d in dead] == [("late_window", 3)]


def test_windows_without_event_time_are_refused_when_built(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="windows need event time"):
        dataclasses.replace(
            pipeline(tmp_path, windows.tumbling("1m").count().final()), event_time=None
        )
    with pytest.raises(ConfigError, match="needs an aggregate"):
        windows.session("5m").final()
