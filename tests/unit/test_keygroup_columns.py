"""Int keys encoded and hashed as a column equal :func:`encode_key` and
:func:`key_group_of_bytes` of each key, at every byte length and sign."""

from __future__ import annotations

import random

import numpy as np
import pyarrow as pa
import pytest

from microbatch.keygroup_columns import LIMIT, int_key_groups, key_groups_of
from microbatch.keygroups import encode_key, key_group_of_bytes

EDGES = [0, 1, -1, 127, 128, -128, -129, 255, 256, 2**15 - 1, 2**15, -(2**15), -(2**15) - 1,
         2**31, -(2**31), 2**55 - 1, 2**55, -(2**55), LIMIT - 1, -(LIMIT - 1)]  # fmt: skip


@pytest.mark.parametrize("max_parallelism", [1, 7, 128, 32768])
def test_a_column_of_int_keys_gets_the_bytes_and_groups_of_each_key_alone(max_parallelism):
    rng = random.Random(max_parallelism)
    keys = EDGES + [rng.randrange(-(2 ** rng.randrange(1, 62)), 2 ** rng.randrange(1, 62))
                    for _ in range(3_000)]  # fmt: skip
    key_bytes, groups = int_key_groups(np.array(keys, dtype=np.int64), max_parallelism)
    want = [encode_key(k) for k in keys]
    assert key_bytes.to_pylist() == want
    assert groups.tolist() == [key_group_of_bytes(b, max_parallelism) for b in want]


def test_no_keys_give_empty_columns():
    key_bytes, groups = int_key_groups(np.array([], dtype=np.int64), 128)
    assert len(key_bytes) == 0 and len(groups) == 0


@pytest.mark.parametrize("beyond", [LIMIT, -LIMIT, 2**63 - 1, -(2**63)])
def test_keys_beyond_the_limit_are_refused_for_the_caller_to_encode_one_by_one(beyond):
    with pytest.raises(ValueError, match="one by one"):
        int_key_groups(np.array([1, beyond], dtype=np.int64), 128)


@pytest.mark.parametrize(
    "keys",
    [
        pa.array(EDGES, pa.int64()),
        pa.array([0, 2**62, -(2**62), 5], pa.int64()),  # beyond the limit: one by one
        pa.array([2**64 - 1, 3], pa.uint64()),  # beyond int64 too
        pa.array([1, -2, 300], pa.int16()),
        pa.array(["", "a", "ü", "card-42"]),
        pa.array([b"", b"\x00\xff"], pa.binary()),
    ],
    ids=["ints", "ints-beyond-limit", "uint64", "int16", "strings", "bytes"],
)
def test_any_column_of_keys_gets_the_bytes_and_groups_of_each_key_alone(keys) -> None:
    key_bytes, groups = key_groups_of(keys, 128)
    want = [encode_key(k) for k in keys.to_pylist()]
    assert key_bytes.to_pylist() == want
    assert groups.tolist() == [key_group_of_bytes(kb, 128) for kb in want]
