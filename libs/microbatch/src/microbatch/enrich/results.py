"""What the enrichment function's return value becomes: no output, one, or many."""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from typing import Any

#: Types that are always exactly one result (checked first: the common case).
SCALARS = frozenset({int, float, str, bytes, bool, dict})


class _InvalidResult(Exception):
    """The enrichment function returned something the operator cannot emit.

    Internal to the enrich package; its name shows in dead letters' ``error`` text
    (``"_InvalidResult: ..."``), so renaming it changes the output.
    """


def normalize(value: Any) -> list[Any]:
    """None → no result, list/tuple → many, anything else → one."""
    if value is None:
        return []
    kind = type(value)
    if kind is list or kind is tuple:
        return list(value)
    if kind in SCALARS:
        return [value]
    if isinstance(value, list | tuple):
        return list(value)
    if inspect.isawaitable(value):
        raise _InvalidResult(
            f"the function returned an awaitable ({type(value).__name__}) as its result: "
            "a blocking=True function must be a plain function"
        )
    if isinstance(value, Iterator | set | frozenset):
        raise _InvalidResult(
            f"the function returned a {type(value).__name__}: return a list for many results"
        )
    return [value]
