"""Sessionization logic of the example pipeline, without services."""

from __future__ import annotations

import random

from microbatch.examples.clickstream import GAP_MS, merge_click, reference_sessions
from microbatch.examples.profile_service import profile_of

MIN = 60_000


def click(ts: int, page: str = "/") -> dict:
    return {"user_id": "u", "page": page, "ts": ts, "segment": "gold"}


def test_clicks_closer_than_the_gap_share_a_session() -> None:
    s = merge_click([], click(0, "/a"), GAP_MS)
    s = merge_click(s, click(29 * MIN, "/b"), GAP_MS)
    assert [(x["start"], x["end"], x["clicks"], x["pages"]) for x in s] == [
        (0, 29 * MIN, 2, ["/a", "/b"])
    ]
    s = merge_click(s, click(59 * MIN), GAP_MS)  # exactly 30 min later: a new session
    assert [(x["start"], x["end"]) for x in s] == [(0, 29 * MIN), (59 * MIN, 59 * MIN)]


def test_a_click_between_two_sessions_bridges_them() -> None:
    s = merge_click([], click(0), GAP_MS)
    s = merge_click(s, click(50 * MIN), GAP_MS)
    assert len(s) == 2
    s = merge_click(s, click(25 * MIN), GAP_MS)
    assert [(x["start"], x["end"], x["clicks"]) for x in s] == [(0, 50 * MIN, 3)]


def test_sessions_do_not_depend_on_click_order() -> None:
    rng = random.Random(7)
    clicks = [click(rng.randrange(0, 600 * MIN), f"/{rng.randrange(5)}") for _ in range(200)]
    in_order: list = []
    for c in sorted(clicks, key=lambda c: c["ts"]):
        in_order = merge_click(in_order, c, GAP_MS)
    shuffled: list = []
    for c in rng.sample(clicks, len(clicks)):
        shuffled = merge_click(shuffled, c, GAP_MS)
    assert shuffled == in_order
    assert sum(s["clicks"] for s in in_order) == 200


def test_reference_closes_only_sessions_the_watermark_passed() -> None:
    clicks = [
        {"user_id": "a", "page": "/", "ts": 0},
        {"user_id": "a", "page": "/x", "ts": 10 * MIN},
        {"user_id": "b", "page": "/", "ts": 100 * MIN},
    ]
    got = reference_sessions(clicks, watermark=40 * MIN)
    assert got == [
        {
            "user_id": "a",
            "session_start": 0,
            "session_end": 10 * MIN,
            "clicks": 2,
            "pages": ["/", "/x"],
            "segment": profile_of("a")["segment"],
        }
    ]
    assert reference_sessions(clicks, watermark=None) == []


def test_profiles_are_stable_functions_of_the_user() -> None:
    assert profile_of("user-1") == profile_of("user-1")
    assert {profile_of(f"u{i}")["segment"] for i in range(50)} == {
        "bronze",
        "silver",
        "gold",
        "platinum",
    }
