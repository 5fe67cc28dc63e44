"""The benches' CPU meter: a process tree's CPU time never goes down when a worker goes."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench"))

from benchlib import process_tree, tree_cpu_seconds

# A parent that ignores SIGCHLD, as pyspark.daemon does, and a child that burns CPU then
# exits: the kernel reaps it without adding its times to the parent's.
PARENT = """
import os, signal, sys, time
signal.signal(signal.SIGCHLD, signal.SIG_IGN)
if os.fork() == 0:
    end = time.process_time() + 0.5
    while time.process_time() < end:
        pass
    while not os.path.exists(sys.argv[1]):  # exit when told
        time.sleep(0.05)
    os._exit(0)
sys.stdin.readline()
"""


def test_a_reaped_workers_cpu_time_stays_counted(tmp_path: Path) -> None:
    told = tmp_path / "exit"
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, str(told)], stdin=subprocess.PIPE, text=True
    )
    try:
        while len(process_tree(parent.pid)) < 2 or sum(process_tree(parent.pid).values()) < (
            0.4 * os.sysconf("SC_CLK_TCK")
        ):
            time.sleep(0.05)  # until the child has burnt its CPU time
        before = tree_cpu_seconds(parent.pid)
        told.touch()  # the child exits; the parent stays
        while len(process_tree(parent.pid)) > 1:
            time.sleep(0.05)
        after = tree_cpu_seconds(parent.pid)
        assert after >= before, f"the tree's CPU time went down: {before:.2f} → {after:.2f} s"
    finally:
        parent.kill()
        parent.wait()
