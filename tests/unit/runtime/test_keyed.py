"""Stage 2's pure helpers (the instance run itself is tested on Spark)."""

from __future__ import annotations

import pyarrow as pa

from microbatch.runtime.keyed import key_runs


def test_key_runs_are_the_row_ranges_of_equal_keys() -> None:
    keys = pa.array([b"a", b"a", b"b", b"c", b"c", b"c", b"d"], pa.binary())

    assert key_runs(keys) == [(0, 2), (2, 3), (3, 6), (6, 7)]


def test_key_runs_reads_across_chunks_and_edge_cases() -> None:
    chunked = pa.chunked_array([[b"a", b"a"], [b"a", b"b"], [b"b"]], pa.binary())

    assert key_runs(chunked) == [(0, 3), (3, 5)]
    assert key_runs(pa.array([b"x"], pa.binary())) == [(0, 1)]
    assert key_runs(pa.array([], pa.binary())) == []
    assert key_runs(pa.chunked_array([], pa.binary())) == []
