"""The manifest: the single commit point of a checkpoint.

A manifest maps every key-group to the byte range holding its state — ``(file, offset,
length, crc32)`` plus its row and key counts — or to ``null`` when the key-group has no
state. Entries of unchanged key-groups point at files of earlier checkpoints (that is
what "incremental" means). ``metadata`` is a JSON object reserved for the other parts of
a micro-batch (source offsets, pending async elements, watermark, sink transactions,
stats); this module stores it and never interprets it.

The JSON carries ``format_version`` (readers refuse versions they do not know) and a
CRC-32 over its own canonical body, so a truncated or edited manifest is an error,
never a silently different checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
import zlib
from collections.abc import Mapping
from typing import Any

from microbatch.checkpoint.layout import check_checkpoint_id
from microbatch.errors import CheckpointError
from microbatch.keygroups import check_max_parallelism, check_parallelism

MANIFEST_VERSION = 1


@dataclasses.dataclass(frozen=True)
class KeyGroupEntry:
    """Byte range of one key-group's state; ``checkpoint_id`` is the one that wrote it."""

    file: str
    offset: int
    length: int
    crc32: int
    rows: int
    keys: int
    checkpoint_id: int

    def __post_init__(self) -> None:
        if self.offset < 0 or self.length <= 0 or self.rows < 0 or self.keys < 0:
            raise CheckpointError(f"bad key-group entry {self}")


@dataclasses.dataclass(frozen=True)
class Manifest:
    """A committed (or about to be committed) checkpoint; validates on construction."""

    checkpoint_id: int
    pipeline_fingerprint: str
    max_parallelism: int
    parallelism: int
    key_groups: tuple[KeyGroupEntry | None, ...]
    full_checkpoint_id: int
    created_at: str
    metadata: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    format_version: int = MANIFEST_VERSION

    def __post_init__(self) -> None:
        check_checkpoint_id(self.checkpoint_id)
        check_parallelism(self.parallelism, check_max_parallelism(self.max_parallelism))
        if len(self.key_groups) != self.max_parallelism:
            raise CheckpointError(
                f"checkpoint {self.checkpoint_id}: {len(self.key_groups)} key-group entries "
                f"for max_parallelism={self.max_parallelism}"
            )
        if self.full_checkpoint_id > self.checkpoint_id:
            raise CheckpointError(
                f"checkpoint {self.checkpoint_id}: full_checkpoint_id "
                f"{self.full_checkpoint_id} is in the future"
            )

    def files(self) -> set[str]:
        """Every state file this manifest references."""
        return {e.file for e in self.key_groups if e is not None}

    @property
    def total_bytes(self) -> int:
        return sum(e.length for e in self.key_groups if e is not None)

    @property
    def total_keys(self) -> int:
        return sum(e.keys for e in self.key_groups if e is not None)

    def to_json(self) -> bytes:
        body = _body(self)
        body["checksum"] = zlib.crc32(_canonical(body))
        return json.dumps(body, indent=1, sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes, where: str) -> Manifest:
        """Parse and verify; ``where`` (checkpoint and key) is named in every error."""
        try:
            body = json.loads(data)
        except (ValueError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{where}: manifest is not valid JSON (truncated?): {e}") from e
        if not isinstance(body, dict):
            raise CheckpointError(f"{where}: manifest is not a JSON object")
        version = body.get("format_version")
        if version != MANIFEST_VERSION:
            raise CheckpointError(
                f"{where}: unknown manifest format_version {version!r} (this microbatch "
                f"reads version {MANIFEST_VERSION}); upgrade microbatch to read it"
            )
        checksum = body.pop("checksum", None)
        if checksum != zlib.crc32(_canonical(body)):
            raise CheckpointError(f"{where}: manifest checksum mismatch: it was altered")
        try:
            entries = tuple(
                None if e is None else KeyGroupEntry(**e) for e in body.pop("key_groups")
            )
            return cls(key_groups=entries, **body)
        except (TypeError, KeyError) as e:
            raise CheckpointError(f"{where}: manifest has a bad field: {e}") from e


def _body(m: Manifest) -> dict[str, Any]:
    body = dataclasses.asdict(m)
    body["metadata"] = dict(m.metadata)
    return body


def _canonical(body: dict[str, Any]) -> bytes:
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
