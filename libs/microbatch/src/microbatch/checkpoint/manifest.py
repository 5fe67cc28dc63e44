"""The manifest: the single commit point of a checkpoint.

A manifest names every immutable state object the checkpoint consists of, in one of two
layouts:

- **sorted runs** (``format_version`` 2, what the runtime writes): ``runs`` lists run
  refs (:class:`~microbatch.state.engine.RunRef`), each a run's data and index
  objects and the key-groups it serves. For any key-group, the runs serving it appear newest
  first, so "the first run holding a key wins"; each instance's part of the list is its
  own stretch, which is why the driver can simply concatenate what the instances return.
  ``key_counts`` has the number of keys with state per key-group (kept incrementally).
  ``key_groups`` is all ``null``.
- **one file per instance** (``format_version`` 1, read for migration): every key-group
  maps to the byte range holding its state — ``(file, offset, length, crc32)`` plus its
  row and key counts — or to ``null`` when it has no state. Entries of unchanged
  key-groups point at files of earlier checkpoints.

A dataflow with several keyed steps keeps the state of its first keyed step in ``runs``
and ``key_counts`` (so a single-operator checkpoint *is* the state of that step), and
every further step's in ``operators``: its uid → :class:`OperatorState` (its own runs and
key counts, the same rules). Absent when empty, so single-operator manifests read back
byte for byte.

``metadata`` is a JSON object reserved for the other parts of a micro-batch (source
offsets, pending async elements, watermark, sink transactions, stats); this module
stores it and never interprets it.

The JSON carries ``format_version`` (readers refuse versions they do not know) and a
CRC-32 over its own canonical body, so a truncated or edited manifest is an error,
never a silently different checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
import zlib
from collections.abc import Collection, Mapping
from typing import Any

from microbatch.checkpoint.layout import check_checkpoint_id
from microbatch.errors import CheckpointError
from microbatch.keygroups import check_max_parallelism, check_parallelism
from microbatch.state.engine import RunRef

#: Version 1: key-group byte ranges only; version 2: sorted runs.
KEY_GROUP_FILES, SORTED_RUNS = 1, 2
MANIFEST_VERSION = SORTED_RUNS
READABLE_VERSIONS = (KEY_GROUP_FILES, SORTED_RUNS)


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
class OperatorState:
    """The state of one further keyed step of a dataflow: its runs (newest first per
    key-group, as the manifest's own) and its keys per key-group."""

    runs: tuple[RunRef, ...]
    key_counts: tuple[int, ...]
    #: The class of the step's function (``module.QualName``): state is read by it only.
    process: str = ""
    #: Processing-time timers per key-group (None: none).
    processing_timer_counts: tuple[int, ...] | None = None

    def to_json(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "runs": [r.to_json() for r in self.runs],
            "key_counts": list(self.key_counts),
            "process": self.process,
        }
        if self.processing_timer_counts is not None:
            body["processing_timer_counts"] = list(self.processing_timer_counts)
        return body

    @classmethod
    def from_json(cls, body: Mapping[str, Any]) -> OperatorState:
        runs = tuple(RunRef.from_json(r) for r in body["runs"])
        ptc = body.get("processing_timer_counts")
        return cls(
            runs,
            tuple(body["key_counts"]),
            str(body.get("process", "")),
            None if ptc is None else tuple(ptc),
        )


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
    #: Sorted runs (None: a version-1 manifest of key-group byte ranges).
    runs: tuple[RunRef, ...] | None = None
    #: Keys with state per key-group (sorted runs only).
    key_counts: tuple[int, ...] | None = None
    format_version: int = KEY_GROUP_FILES
    #: The further keyed steps' state, by uid (see the module docstring).
    operators: Mapping[str, OperatorState] = dataclasses.field(default_factory=dict)
    #: The uid of the keyed step whose state ``runs`` is (None: not named, as in a
    #: single-operator pipeline without uid).
    first_uid: str | None = None
    #: Processing-time timers per key-group of the first step (None: none; sorted runs).
    processing_timer_counts: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        version = KEY_GROUP_FILES if self.runs is None else SORTED_RUNS
        object.__setattr__(self, "format_version", version)
        object.__setattr__(self, "operators", dict(self.operators))
        for uid, op in self.operators.items():
            if self.runs is None or len(op.key_counts) != self.max_parallelism:
                raise CheckpointError(
                    f"checkpoint {self.checkpoint_id}: the state of step {uid!r} must be "
                    f"sorted runs with one key count per key-group ({self.max_parallelism})"
                )
        if self.runs is not None:
            if any(e is not None for e in self.key_groups):
                raise CheckpointError(
                    f"checkpoint {self.checkpoint_id}: a manifest of sorted runs has no "
                    "key-group byte ranges"
                )
            if self.key_counts is None or len(self.key_counts) != self.max_parallelism:
                raise CheckpointError(
                    f"checkpoint {self.checkpoint_id}: key_counts must have one count per "
                    f"key-group ({self.max_parallelism})"
                )
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

    @property
    def is_runs(self) -> bool:
        return self.runs is not None

    def files(self) -> set[str]:
        """Every state object this manifest references (every step's)."""
        if self.runs is not None:
            runs = [*self.runs, *(r for op in self.operators.values() for r in op.runs)]
            return {k for r in runs for k in (r.data, r.index)}
        return {e.file for e in self.key_groups if e is not None}

    def without_steps(self, uids: Collection[str]) -> Manifest:
        """This checkpoint minus the state of further steps ``uids`` (dropped on purpose)."""
        kept = {u: op for u, op in self.operators.items() if u not in uids}
        return dataclasses.replace(self, operators=kept)

    def for_operator(self, uid: str) -> Manifest:
        """This checkpoint as the one step ``uid`` sees it: that step's runs and key
        counts in place of the first step's (empty if the step has no state yet)."""
        op = self.operators.get(uid, OperatorState((), (0,) * self.max_parallelism))
        return dataclasses.replace(
            self,
            runs=op.runs,
            key_counts=op.key_counts,
            operators={},
            processing_timer_counts=op.processing_timer_counts,
        )

    @property
    def total_bytes(self) -> int:
        if self.runs is not None:
            return sum({r.data: r.bytes for r in self.runs}.values())
        return sum(e.length for e in self.key_groups if e is not None)

    @property
    def total_keys(self) -> int:
        if self.key_counts is not None:
            return sum(self.key_counts)
        return sum(e.keys for e in self.key_groups if e is not None)

    def key_group_sizes(self) -> list[tuple[int, int]]:
        """``(bytes, keys)`` per key-group. With sorted runs the bytes are estimated from
        the key counts (runs are not split by key-group): the state's bytes per key."""
        if self.key_counts is None:
            return [(0, 0) if e is None else (e.length, e.keys) for e in self.key_groups]
        per_key = self.total_bytes / max(self.total_keys, 1)
        return [(round(n * per_key), n) for n in self.key_counts]

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
        if version not in READABLE_VERSIONS:
            raise CheckpointError(
                f"{where}: unknown manifest format_version {version!r} (this microbatch "
                f"reads versions {', '.join(map(str, READABLE_VERSIONS))}); upgrade "
                "microbatch to read it"
            )
        checksum = body.pop("checksum", None)
        if checksum != zlib.crc32(_canonical(body)):
            raise CheckpointError(f"{where}: manifest checksum mismatch: it was altered")
        try:
            entries = tuple(
                None if e is None else KeyGroupEntry(**e) for e in body.pop("key_groups")
            )
            operators = body.pop("operators", None)
            if operators is not None:
                body["operators"] = {
                    uid: OperatorState.from_json(op) for uid, op in operators.items()
                }
            ptc = body.pop("processing_timer_counts", None)
            if ptc is not None:
                body["processing_timer_counts"] = tuple(ptc)
            runs = body.pop("runs", None)
            if runs is not None:
                body["runs"] = tuple(RunRef.from_json(r) for r in runs)
                body["key_counts"] = tuple(body.pop("key_counts"))
            return cls(key_groups=entries, **body)
        except (TypeError, KeyError) as e:
            raise CheckpointError(f"{where}: manifest has a bad field: {e}") from e


def _body(m: Manifest) -> dict[str, Any]:
    body = dataclasses.asdict(m)
    body["metadata"] = dict(m.metadata)
    if m.runs is None:  # a version-1 manifest reads back byte for byte
        del body["runs"], body["key_counts"]
    else:
        body["runs"] = [r.to_json() for r in m.runs]
        body["key_counts"] = list(m.key_counts or ())
    if m.operators:
        body["operators"] = {uid: op.to_json() for uid, op in m.operators.items()}
    else:
        del body["operators"]
    if m.first_uid is None:
        del body["first_uid"]
    if m.processing_timer_counts is None:
        del body["processing_timer_counts"]
    else:
        body["processing_timer_counts"] = list(m.processing_timer_counts)
    return body


def _canonical(body: dict[str, Any]) -> bytes:
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
