"""Per-batch overhead: cold spark-submit (local) vs standalone cluster vs warm Spark Connect.

Runs the same job (today the foundation smoke job; the pipeline batch once it exists) on
an empty topic and on a 100k-record topic, through each engine, and prints wall times and
ratios against cold local spark-submit measured in the same run. Target (issue 8): a warm
empty batch ≤ 2 s and ≥ 4× faster than cold.

    .venv/bin/python bench/bench_spark_modes.py [--records 100000] [--repeat 2]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import tempfile
import time
from pathlib import Path

from microbatch.localstack import KafkaBroker, SeaweedFS
from microbatch.localstack.process import free_port_block
from microbatch.localstack.seaweedfs import ALL_OFFSETS
from microbatch.localstack.spark_cluster import SparkStandaloneCluster
from microbatch.localstack.spark_connect import SparkConnectServer
from microbatch.runner import run_job
from microbatch.settings import Settings
from microbatch.smoke import ensure_topic, produce_events

REPO = Path(__file__).resolve().parents[1]
JOB = REPO / "jobs" / "smoke.py"


def timed_batch(settings: Settings, topic: str, run_id: str) -> float:
    started = time.monotonic()
    run_job(JOB, ["--no-produce", "--topic", topic, "--run-id", run_id], settings, lambda _: None)
    return time.monotonic() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--records", type=int, default=100_000)
    parser.add_argument("--repeat", type=int, default=2)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-spark-modes-"))
    settings = Settings.from_env(
        kafka_bootstrap_servers=f"127.0.0.1:{free_port_block([0, 1])}",
        s3_endpoint_url=f"http://127.0.0.1:{free_port_block(ALL_OFFSETS)}",
        home=str(REPO / ".local"),
    )
    services = [KafkaBroker(settings, work / "kafka"), SeaweedFS(settings, work / "s3")]
    cluster = SparkStandaloneCluster(free_port_block([0, 1, 2, 3]), work / "cluster")
    connect = SparkConnectServer(free_port_block([0]), work / "connect", "local[2]")
    try:
        print("starting Kafka, SeaweedFS, a 2-worker standalone cluster, a Connect server ...")
        for service in (*services, cluster, connect):
            service.start()
        ensure_topic(settings, "bench-empty", 3)
        ensure_topic(settings, "bench-full", 3)
        print(f"producing {args.records:,} records ...")
        produce_events(settings, "bench-full", args.records)
        modes = {
            "cold spark-submit local[2]": dataclasses.replace(settings, spark_master="local[2]"),
            "standalone cluster (2 workers)": dataclasses.replace(
                settings, spark_master=cluster.url
            ),
            "warm Spark Connect": dataclasses.replace(settings, spark_master=connect.url),
        }
        # One untimed warm-up through Connect: its first session pays one-time set-up.
        timed_batch(modes["warm Spark Connect"], "bench-empty", "warmup")
        results: dict[str, dict[str, float]] = {}
        for name, mode in modes.items():
            results[name] = {}
            for topic in ("bench-empty", "bench-full"):
                runs = [
                    timed_batch(mode, topic, f"{topic}-{i}-{abs(hash(name))}")
                    for i in range(args.repeat)
                ]
                results[name][topic] = statistics.median(runs)
                print(f"  {name:<32} {topic:<12} {results[name][topic]:6.2f} s (median)")
        cold = results["cold spark-submit local[2]"]
        print(
            f"\nwall time per batch, median of {args.repeat}; ratio = cold / mode (higher = faster)"
        )
        print(
            f"{'mode':<32} {'empty':>8} {'ratio':>6} {f'{args.records // 1000}k':>8} {'ratio':>6}"
        )
        for name, times in results.items():
            print(
                f"{name:<32} {times['bench-empty']:7.2f}s "
                f"{cold['bench-empty'] / times['bench-empty']:5.1f}x "
                f"{times['bench-full']:7.2f}s {cold['bench-full'] / times['bench-full']:5.1f}x"
            )
        warm = results["warm Spark Connect"]["bench-empty"]
        print(
            f"\ntarget: warm empty batch <= 2 s ({'met' if warm <= 2 else 'NOT met'}: {warm:.2f} s)"
            f" and >= 4x faster than cold ({cold['bench-empty'] / warm:.1f}x)"
        )
    finally:
        for service in (connect, cluster, *reversed(services)):
            service.stop()


if __name__ == "__main__":
    main()
