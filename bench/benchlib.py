"""Shared by the benchmarks: the result table every bench prints, the load average, CPU
seconds and memory of the Spark process tree, and producing a topic's events."""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
import statistics
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any


def print_table(rows: list[tuple[str, str, str]]) -> None:
    """``metric  value  notes`` rows, aligned, under a header."""
    w0 = max(len(r[0]) for r in rows)
    w1 = max(len(r[1]) for r in rows)
    print(f"\n{'metric':<{w0}}  {'value':>{w1}}  notes")
    print(f"{'-' * w0}  {'-' * w1}  {'-' * 40}")
    for name, value, note in rows:
        print(f"{name:<{w0}}  {value:>{w1}}  {note}")


def print_ratios(times: dict[str, list[float]], pairs: list[tuple[str, str]]) -> None:
    """For each ``(ours, reference)`` of ``pairs``: both paths' CPU seconds over the
    rounds, median (best), and on ours the ratio of the medians, reference ÷ ours."""
    rows = []
    for ours, reference in pairs:
        ratio = statistics.median(times[reference]) / statistics.median(times[ours])
        for name in (ours, reference):
            ts = times[name]
            shown = f"{ratio:.2f}×" if name == ours else ""
            rows.append((name, f"{statistics.median(ts):.3f} ({min(ts):.3f})", shown))
    print_table(rows)


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def load() -> str:
    return f"load {os.getloadavg()[0]:.1f}/{os.cpu_count()} cpus"


def spark_cpu_seconds(spark: Any) -> float:
    """CPU seconds so far of this process, the Spark JVM and every process under it
    (Python workers, also those gone: :func:`tree_cpu_seconds`). Not the broker."""
    return tree_cpu_seconds(spark.sparkContext._gateway.proc.pid)


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


# Processes: CPU time and memory of a process tree (the Spark JVM and its Python workers) -


def _stat(pid: int) -> tuple[int, int]:
    """(parent pid, utime + stime + cutime + cstime in clock ticks) of a live process."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[1]), sum(int(x) for x in fields[11:15])


def process_tree(root: int) -> dict[int, int]:
    """Pid → CPU ticks of ``root`` and every live process under it, from /proc."""
    stats: dict[int, tuple[int, int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stats[int(entry)] = _stat(int(entry))
            except (OSError, IndexError, ValueError):
                continue  # gone meanwhile
    tree, frontier = {root}, [root]
    while frontier:
        parent = frontier.pop()
        children = [pid for pid, (ppid, _) in stats.items() if ppid == parent]
        tree.update(children)
        frontier += children
    return {pid: stats[pid][1] for pid in tree if pid in stats}


#: Per root: the ticks of each process under it at the last call, and those of the
#: processes gone since (see :func:`tree_cpu_seconds`).
_LAST_SEEN: dict[int, dict[int, int]] = {}
_GONE: dict[int, int] = {}


def tree_cpu_seconds(root: int) -> float:
    """CPU seconds so far of this process plus ``root`` and every process under it; never
    less than at the last call.

    ``pyspark.daemon`` ignores SIGCHLD, so the kernel reaps its exited Python workers
    without adding their times to its children times: a worker's CPU time would vanish
    with it, and a run during which an idle worker of an earlier run exited would measure
    less than nothing (Spark's q0 at 10M: -3.0 CPU-s). A process gone since the last call
    keeps the ticks it had then."""
    tree = process_tree(root)
    last = _LAST_SEEN.get(root, {})
    _GONE[root] = _GONE.get(root, 0) + sum(t for pid, t in last.items() if pid not in tree)
    _LAST_SEEN[root] = tree
    own = os.times()
    ticks = sum(tree.values()) + _GONE[root]
    return ticks / os.sysconf("SC_CLK_TCK") + own.user + own.system


def _status_kib(pid: int, fields: tuple[str, ...]) -> dict[str, int]:
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name in fields:
                out[name] = int(rest.split()[0])
    return out


class RssSampler:
    """Samples the resident memory of the Python processes under a root process (Spark's
    ``pyspark.daemon`` and the workers it forks) every ``interval_s``, keeping per phase
    the largest ``VmRSS`` seen and the largest ``VmHWM`` (the kernel's own peak) of any
    one process. ``phase`` names what runs now; ``peaks()`` gives MiB per phase.

    The process tree is listed again every ``rescan_s`` only (a walk of /proc costs a few
    ms); ``cpu_seconds`` is the sampler's own CPU time, to leave out of measurements."""

    def __init__(
        self,
        root: int,
        interval_s: float = 0.05,
        rescan_s: float = 0.5,
        match: str = "pyspark.daemon",
    ) -> None:
        self.root, self.interval_s, self.rescan_s, self.match = root, interval_s, rescan_s, match
        self.phase = "idle"
        self.cpu_seconds = 0.0
        self._peaks: dict[str, list[int]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="rss-sampler", daemon=True)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _workers(self) -> list[int]:
        pids = []
        for pid in process_tree(self.root):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if self.match.encode() in f.read():
                        pids.append(pid)
            except OSError:
                continue
        return pids

    def _loop(self) -> None:
        workers: list[int] = []
        listed = 0.0
        while not self._stop.wait(self.interval_s):
            if time.monotonic() - listed >= self.rescan_s:
                workers, listed = self._workers(), time.monotonic()
            peak = self._peaks.setdefault(self.phase, [0, 0])
            for pid in workers:
                try:
                    kib = _status_kib(pid, ("VmRSS", "VmHWM"))
                except (OSError, ValueError):
                    continue
                peak[0] = max(peak[0], kib.get("VmRSS", 0))
                peak[1] = max(peak[1], kib.get("VmHWM", 0))
            self.cpu_seconds = time.thread_time()

    def peaks(self) -> dict[str, tuple[float, float]]:
        """Phase → (largest VmRSS, largest VmHWM) of one process, in MiB."""
        return {k: (v[0] / 1024, v[1] / 1024) for k, v in self._peaks.items()}


@contextlib.contextmanager
def kafka_settings(work: Path, home: Path) -> Iterator[Any]:
    """Settings for a bench on Spark ``local[2]``: the broker at
    ``MICROBATCH_KAFKA_BOOTSTRAP_SERVERS`` if set, else one started on free loopback ports
    with its data in ``work`` and stopped at the end."""
    from microbatch.localstack import KafkaBroker
    from microbatch.localstack.process import free_port_block
    from microbatch.settings import Settings

    common = {"spark_master": "local[2]", "home": str(home)}
    if "MICROBATCH_KAFKA_BOOTSTRAP_SERVERS" in os.environ:
        yield Settings.from_env(**common)
        return
    port = free_port_block([0, 1])
    settings = Settings.from_env(kafka_bootstrap_servers=f"127.0.0.1:{port}", **common)
    broker = KafkaBroker(settings, work / "kafka")
    log(f"starting Kafka at {settings.kafka_bootstrap_servers} ...")
    broker.start()
    try:
        yield settings
    finally:
        broker.stop()


def spark_stages(spark: Any, after: int) -> list[dict[str, Any]]:
    """Completed stages with an id above ``after`` (Spark's REST API), oldest first; none
    without the UI."""
    sc = spark.sparkContext
    if not sc.uiWebUrl:
        return []
    url = f"{sc.uiWebUrl}/api/v1/applications/{sc.applicationId}/stages?status=complete"
    for _ in range(20):  # the UI's listener catches up asynchronously
        with urllib.request.urlopen(url, timeout=10) as response:
            stages = [s for s in json.load(response) if s["stageId"] > after]
        if stages or after < 0:
            break
        time.sleep(0.25)
    return sorted(stages, key=lambda s: s["stageId"])


def last_stage_id(spark: Any) -> int:
    return max((s["stageId"] for s in spark_stages(spark, -1)), default=-1)


def finish_query(query: Any, started: float) -> float:
    """Wait for a Structured Streaming query (``availableNow``) to end: wall seconds since
    ``started``; a failed query stops the bench with its error."""
    query.awaitTermination()
    elapsed = time.perf_counter() - started
    if query.exception() is not None:
        raise SystemExit(f"Structured Streaming query failed: {query.exception()}")
    return elapsed


def where_time_goes(pipeline: Any, settings: Any, result: Any) -> list[str]:
    """The (last) batch's phases (``result``: its ``BatchResult``) and each keyed step's
    stage-2 seconds, summed over instances (from the committed batch's stats)."""
    from microbatch.checkpoint import Layout, latest_manifest
    from microbatch.runtime.records import BatchRecord
    from microbatch.storage import open_store

    manifest = latest_manifest(open_store(pipeline.checkpoints, settings), Layout())
    stats = BatchRecord.of(manifest).stats
    phases = {k: round(v, 2) for k, v in result.seconds.items()}
    lines = [f"  batch phases (s): {json.dumps(phases)}"]
    sums: dict[str, dict[str, float]] = {}
    for inst in stats.instances if stats else ():
        for k, v in inst.seconds.items():
            step, _, what = k.rpartition(".")
            per = sums.setdefault(step or pipeline.uid or "(sinks only)", {})
            per[what] = per.get(what, 0.0) + v
    for step, per in sums.items():
        rounded = {k: round(v, 2) for k, v in per.items()}
        lines.append(f"  step {step}, instances' sum (s): {rounded}")
    return lines


def stage_lines(spark: Any, after: int) -> list[str]:
    """One line per Spark stage of the batch: wall, task time, JVM CPU, shuffle."""

    def ms(stamp: str | None) -> float:  # the REST API's 2026-11-25T12:00:00.123GMT
        if not stamp:
            return 0.0
        at = dt.datetime.strptime(stamp.replace("GMT", "+0000"), "%Y-%m-%dT%H:%M:%S.%f%z")
        return at.timestamp() * 1000

    lines = []
    for s in spark_stages(spark, after):
        wall = (ms(s.get("completionTime")) - ms(s.get("submissionTime"))) / 1000
        lines.append(
            f"  Spark stage {s['stageId']} ({s['numTasks']} tasks, {s['name'][:40]}): "
            f"{wall:.2f} s wall, {s['executorRunTime'] / 1000:.2f} s task time, "
            f"{s['executorCpuTime'] / 1e9:.2f} s JVM CPU, shuffle write "
            f"{s.get('shuffleWriteBytes', 0) / 1e6:.1f} MB"
        )
    return lines
