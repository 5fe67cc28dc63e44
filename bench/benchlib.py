"""Shared by the benchmarks: the result table every bench prints, the load average, CPU
seconds of the Spark process tree, and producing a topic's events."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from typing import Any


def print_table(rows: list[tuple[str, str, str]]) -> None:
    """``metric  value  notes`` rows, aligned, under a header."""
    w0 = max(len(r[0]) for r in rows)
    w1 = max(len(r[1]) for r in rows)
    print(f"\n{'metric':<{w0}}  {'value':>{w1}}  notes")
    print(f"{'-' * w0}  {'-' * w1}  {'-' * 40}")
    for name, value, note in rows:
        print(f"{name:<{w0}}  {value:>{w1}}  {note}")


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def load() -> str:
    return f"load {os.getloadavg()[0]:.1f}/{os.cpu_count()} cpus"


def _cpu_ticks(pid: int) -> tuple[int, int]:
    """(parent pid, utime + stime + cutime + cstime) of a live process, from /proc."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[1]), sum(int(x) for x in fields[11:15])


def spark_cpu_seconds(spark: Any) -> float:
    """CPU seconds so far of this process, the Spark JVM and every live process under it
    (Python workers; reaped ones are in their parent's children times). Not the broker."""
    jvm = spark.sparkContext._gateway.proc.pid
    ticks: dict[int, tuple[int, int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                ticks[int(entry)] = _cpu_ticks(int(entry))
            except (OSError, IndexError, ValueError):
                continue
    tree, frontier = {jvm}, [jvm]
    while frontier:
        parent = frontier.pop()
        children = [pid for pid, (ppid, _) in ticks.items() if ppid == parent]
        tree.update(children)
        frontier += children
    total = sum(ticks[pid][1] for pid in tree if pid in ticks)
    own = os.times()
    return total / os.sysconf("SC_CLK_TCK") + own.user + own.system


def produce(
    bootstrap: str, topic: str, n: int, event: Callable[[int], bytes], partitions: int
) -> None:
    """Create ``topic`` and send ``event(i)`` for ``i < n`` to partition ``i % partitions``
    (one batching producer, acks=1), logging progress."""
    from kafka import KafkaAdminClient, KafkaProducer

    admin = KafkaAdminClient(bootstrap_servers=bootstrap)
    try:
        spec = {"num_partitions": partitions, "replication_factor": 1}
        admin.create_topics({topic: spec}, wait_for_metadata=True)
    finally:
        admin.close()
    producer = KafkaProducer(
        bootstrap_servers=bootstrap,
        acks=1,
        linger_ms=50,
        batch_size=1024 * 1024,
        max_request_size=16 * 1024 * 1024,
    )
    started = time.monotonic()
    step = max(n // 10, 1)
    try:
        for i in range(n):
            producer.send(topic, value=event(i), partition=i % partitions)
            if (i + 1) % step == 0:
                elapsed = time.monotonic() - started
                log(f"  {topic}: {i + 1:>10,} / {n:,} sent ({(i + 1) / elapsed:,.0f}/s)")
        producer.flush()
    finally:
        producer.close()
    elapsed = time.monotonic() - started
    log(f"  {topic}: {n:,} records produced in {elapsed:.1f} s ({n / elapsed:,.0f}/s)")
