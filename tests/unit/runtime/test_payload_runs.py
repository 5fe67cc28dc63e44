"""Stage 2 decodes a step's payloads a run at a time: each key still gets exactly its
own records, fresh objects, whatever the sizes of the keys around a run's edge."""

from __future__ import annotations

import random

from microbatch.runtime.columnar import PayloadRuns
from microbatch.runtime.envelope import decode_payload, decode_payloads, encode_payloads


def test_every_key_gets_its_records_across_run_edges_and_long_keys() -> None:
    rng = random.Random(7)
    records = [{"id": n, "name": f"p{n}", "tags": [n % 3]} for n in range(5_000)]
    payloads = encode_payloads(records)
    sizes = [1] * 700 + [rng.randrange(1, 9) for _ in range(300)] + [2_500, 5_000]
    calls: list[int] = []

    def decode(run: list[bytes]) -> list:
        calls.append(len(run))
        return decode_payloads(run)

    runs, at, got = PayloadRuns(payloads, decode), 0, []
    for size in sizes:
        if at >= len(payloads):
            break
        j = min(at + size, len(payloads))
        got.append((at, runs(at, j)))
        at = j

    for start, batch in got:
        assert batch == [decode_payload(p) for p in payloads[start : start + len(batch)]]
    assert sum(len(b) for _, b in got) == len(payloads)
    assert len(calls) < len(got) / 50  # a run serves many keys
    assert got[0][1][0] is not got[1][1][0]


def test_a_range_before_the_current_run_is_decoded_again() -> None:
    payloads = encode_payloads([{"n": n} for n in range(3_000)])
    runs = PayloadRuns(payloads, decode_payloads)

    assert runs(2_000, 2_002) == [{"n": 2_000}, {"n": 2_001}]
    assert runs(5, 7) == [{"n": 5}, {"n": 6}]
    assert runs(0, 3_000)[2_999] == {"n": 2_999}
