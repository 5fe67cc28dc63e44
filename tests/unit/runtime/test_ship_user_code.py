"""The user's code Spark's workers need: also functions held by library objects (a join's
select and time functions) and by the edges of a dataflow graph."""

from __future__ import annotations

from typing import Any

from microbatch.joins import IntervalJoin
from microbatch.runtime.execute import held_by_library_objects


def shout(left: Any, right: Any) -> Any:
    return {"left": left, "right": right}


def when(record: Any) -> int:
    return int(record["t"])


def test_functions_a_join_holds_are_found_two_attributes_down() -> None:
    join = IntervalJoin(when, "ts", between=(-1_000, 1_000), select=shout)
    held = held_by_library_objects([join])
    assert shout in held  # join.select
    assert when in held  # join.left_time (an EventTimeOf) .spec


def test_objects_of_the_users_own_are_not_walked() -> None:
    class Mine:
        def __init__(self) -> None:
            self.fn = shout

    assert held_by_library_objects([Mine()]) == []
