"""What a join emits for a pair: ``select(left, right) -> record``; :func:`merge` by default.

``merge`` makes one flat dict: the left record's fields, then the right record's. A field
in both with the same value appears once; with different values the left's value keeps
the name and the right's is added as ``<name>_right`` (``<name>_right_right`` if the left
has a ``<name>_right`` too). In an outer join's unmatched row the missing side is ``None``
and contributes no fields, so the row has only the present side's fields::

    >>> merge({"id": 1, "price": 5}, {"id": 1, "price": 7, "seller": "s"})
    {'id': 1, 'price': 5, 'price_right': 7, 'seller': 's'}
    >>> merge({"id": 1}, None)
    {'id': 1}

A custom ``select`` gets the same arguments (either may be ``None`` in an outer join) and
may return any record the step's sinks accept.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from microbatch.errors import ConfigError

Select = Callable[[Any, Any], Any]


def merge(left: dict[str, Any] | None, right: dict[str, Any] | None) -> dict[str, Any]:
    """The left's fields, then the right's (see the module doc); both records unchanged."""
    for side, record in (("left", left), ("right", right)):
        if record is not None and not isinstance(record, dict):
            raise TypeError(
                f"the default select merges dict records; the {side} record is a "
                f"{type(record).__name__} ({record!r:.80}): pass select=(left, right) -> record"
            )
    out = dict(left or {})
    for name, value in (right or {}).items():
        if name not in out:
            out[name] = value
        elif out[name] != value:
            alias = f"{name}_right"
            while alias in out:
                alias += "_right"
            out[alias] = value
    return out


def check_select(op: str, select: Select | None) -> Select:
    """``select``, or :func:`merge` for None; anything not callable is refused."""
    if select is None:
        return merge
    if not callable(select):
        raise ConfigError(f"{op} select must be a function (left, right) -> record: {select!r}")
    return select
