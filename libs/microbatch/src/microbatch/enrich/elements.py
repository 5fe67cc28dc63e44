"""The value types that go into and come out of the async operator.

:class:`Element` (an input record with its source coordinates), :class:`Watermark`,
:class:`Output` (one result), :class:`DeadLetter` (an input that failed or timed out) and
:class:`PendingElement` (an input not emitted at a snapshot, re-issued by the next batch;
stored in the checkpoint with the state codec). All are immutable.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

from microbatch.errors import EnrichmentError
from microbatch.state.codec import CodecError, decode_value, encode_value

#: ``(topic, partition, offset)`` of an input record.
Coordinates = tuple[str, int, int]

_PENDING_VERSION = 1


# Element and Output are made once per record: their ``__init__`` sets the slots through
# their descriptors instead of ``object.__setattr__`` per field (what a frozen dataclass
# does), which costs 40 % less and keeps them just as immutable.


@dataclass(frozen=True, slots=True, init=False)
class Element:
    """One input record and where it came from (``(topic, partition, offset)``)."""

    record: Any
    coordinates: Coordinates | None = None
    key: Hashable = None

    def __init__(
        self, record: Any, coordinates: Coordinates | None = None, key: Hashable = None
    ) -> None:
        _set_record(self, record)
        _set_element_coordinates(self, coordinates)
        _set_key(self, key)


@dataclass(frozen=True, slots=True, init=False)
class Output:
    """One result of the enrichment function for the input at ``coordinates``."""

    value: Any
    coordinates: Coordinates | None = None

    def __init__(self, value: Any, coordinates: Coordinates | None = None) -> None:
        _set_value(self, value)
        _set_output_coordinates(self, coordinates)


_set_record = Element.record.__set__  # type: ignore[attr-defined]
_set_element_coordinates = Element.coordinates.__set__  # type: ignore[attr-defined]
_set_key = Element.key.__set__  # type: ignore[attr-defined]
_set_value = Output.value.__set__  # type: ignore[attr-defined]
_set_output_coordinates = Output.coordinates.__set__  # type: ignore[attr-defined]


@dataclass(frozen=True, slots=True)
class DeadLetter:
    """An input that failed or timed out, emitted instead of results (``dead_letter``).

    ``reason`` is ``"timeout"``, ``"error"`` or ``"invalid_result"``; ``attempts`` counts
    the calls made, across batches.
    """

    record: Any
    reason: str
    error: str
    attempts: int
    coordinates: Coordinates | None = None
    first_attempt_s: float | None = field(default=None, compare=False)


@dataclass(frozen=True, slots=True)
class Watermark:
    """An event-time watermark passing through the operator."""

    ts: int | float


@dataclass(frozen=True, slots=True)
class PendingElement:
    """An input not yet emitted at a snapshot, with its retry state; re-issued on restore.

    ``attempts`` counts the attempts that already *failed* (an attempt cut off by the
    snapshot does not count); ``first_attempt_s`` is the wall-clock time of the first
    call, in any batch. A watermark is stored with ``watermark`` set and no record.
    """

    record: Any = None
    coordinates: Coordinates | None = None
    key: Hashable = None
    attempts: int = 0
    first_attempt_s: float | None = None
    watermark: int | float | None = None

    @classmethod
    def of(cls, item: Element | Watermark) -> PendingElement:
        """The pending form of an input that never started."""
        if isinstance(item, Watermark):
            return cls(watermark=item.ts)
        return cls(item.record, item.coordinates, item.key)

    def to_bytes(self) -> bytes:
        """Encode with the state codec (records and keys must be plain data)."""
        try:
            return encode_value(
                (
                    _PENDING_VERSION,
                    self.record,
                    self.coordinates,
                    self.key,
                    self.attempts,
                    self.first_attempt_s,
                    self.watermark,
                )
            )
        except CodecError as e:
            raise EnrichmentError(
                f"cannot snapshot the pending input at {where(self.coordinates)}: {e}"
            ) from e

    @classmethod
    def from_bytes(cls, data: bytes) -> PendingElement:
        """Decode bytes written by :meth:`to_bytes`."""
        value = decode_value(data)
        if not isinstance(value, tuple) or len(value) != 7 or value[0] != _PENDING_VERSION:
            raise EnrichmentError(
                f"not a pending element of version {_PENDING_VERSION}: {value!r:.200}"
            )
        _, record, coordinates, key, attempts, first, watermark = value
        return cls(record, coordinates, key, attempts, first, watermark)


def where(coordinates: Coordinates | None, seq: int | None = None) -> str:
    if coordinates is not None:
        topic, partition, offset = coordinates
        return f'"{topic}"[{partition}]@{offset}'
    return "an input without source coordinates" + ("" if seq is None else f" (#{seq})")
