"""A declared state: the name, kind and TTL that user code asks a key's state for."""

from __future__ import annotations

import dataclasses
from typing import Literal

from microbatch.errors import StateError

Kind = Literal["value", "list", "map"]
KINDS: tuple[str, ...] = ("value", "list", "map")


@dataclasses.dataclass(frozen=True)
class StateSpec:
    """A declared state: its name, kind and TTL in seconds (None: never expires)."""

    name: str
    kind: Kind
    ttl: float | None = None

    def __post_init__(self) -> None:
        if not self.name or not isinstance(self.name, str):
            raise StateError(f"state name must be a non-empty string: {self.name!r}")
        if self.kind not in KINDS:
            raise StateError(f"state kind must be one of {KINDS}: {self.kind!r}")
        if self.ttl is not None and not self.ttl > 0:
            raise StateError(f"TTL of state {self.name!r} must be > 0 seconds: {self.ttl!r}")
