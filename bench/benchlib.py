"""Shared by the benchmarks: the result table every bench prints."""

from __future__ import annotations


def print_table(rows: list[tuple[str, str, str]]) -> None:
    """``metric  value  notes`` rows, aligned, under a header."""
    w0 = max(len(r[0]) for r in rows)
    w1 = max(len(r[1]) for r in rows)
    print(f"\n{'metric':<{w0}}  {'value':>{w1}}  notes")
    print(f"{'-' * w0}  {'-' * w1}  {'-' * 40}")
    for name, value, note in rows:
        print(f"{name:<{w0}}  {value:>{w1}}  {note}")
