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

:func:`fields` names the output instead of computing it: which fields of each side, under
which names. A table, window or inner interval join whose ``select`` is ``fields(...)``
can then join column by column where its inputs' records are alike (rows of a declared
schema, a window's output rows), with no record built per row
(:mod:`microbatch.runtime.side_columns`). On records it gives the same dict, a missing
side's fields ``None``::

    >>> pick = fields(left=["id"], right={"seller": "name"})
    >>> pick({"id": 1, "price": 5}, {"name": "Ann", "city": "Oslo"})
    {'id': 1, 'seller': 'Ann'}
    >>> pick({"id": 2, "price": 5}, None)
    {'id': 2, 'seller': None}
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
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


class Fields:
    """The output record of a pair as named fields of each side (:func:`fields`)."""

    def __init__(self, left: tuple[tuple[str, str], ...], right: tuple[tuple[str, str], ...]):
        #: ``(output name, field)`` of each side, in output order: left's, then right's.
        self.left, self.right = left, right

    def __call__(self, left: Any, right: Any) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for side, record, picked in (("left", left, self.left), ("right", right, self.right)):
            if record is None:
                out.update((name, None) for name, _ in picked)
                continue
            try:
                out.update((name, record[field]) for name, field in picked)
            except (KeyError, TypeError, IndexError):
                missing = [f for _, f in picked if not _has(record, f)]
                raise KeyError(
                    f"select=fields(...) reads {missing} of the {side} record, which has "
                    f"no such field ({record!r:.100})"
                ) from None
        return out

    def __repr__(self) -> str:
        return f"fields(left={dict(self.left)!r}, right={dict(self.right)!r})"

    @property
    def names(self) -> list[str]:
        """The output record's fields, in order."""
        return [name for name, _ in (*self.left, *self.right)]


def fields(
    left: Sequence[str] | Mapping[str, str] = (), right: Sequence[str] | Mapping[str, str] = ()
) -> Fields:
    """A join's output as fields of its sides: a list keeps names, a mapping renames
    (``{output name: field}``). An output name given twice is refused."""
    picked = (_picked("left", left), _picked("right", right))
    names = [name for name, _ in (*picked[0], *picked[1])]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ConfigError(
            f"select=fields(...) names output field(s) {twice} twice; rename one side's "
            "with a mapping, e.g. right={'price_right': 'price'}"
        )
    if not names:
        raise ConfigError("select=fields(...) names no field: give left=[...] or right=[...]")
    return Fields(*picked)


def _picked(side: str, given: Sequence[str] | Mapping[str, str]) -> tuple[tuple[str, str], ...]:
    if isinstance(given, str):
        raise ConfigError(f"fields({side}=...) takes a list of names, not one string: {given!r}")
    pairs = list(given.items()) if isinstance(given, Mapping) else [(f, f) for f in given]
    for name, field in pairs:
        if not (isinstance(name, str) and isinstance(field, str)):
            raise ConfigError(f"fields({side}=...) takes field names (str): {name!r}: {field!r}")
    return tuple(pairs)


def _has(record: Any, field: str) -> bool:
    try:
        record[field]
    except (KeyError, TypeError, IndexError):
        return False
    return True


def check_select(op: str, select: Select | None) -> Select:
    """``select``, or :func:`merge` for None; anything not callable is refused."""
    if select is None:
        return merge
    if not callable(select):
        raise ConfigError(f"{op} select must be a function (left, right) -> record: {select!r}")
    return select
