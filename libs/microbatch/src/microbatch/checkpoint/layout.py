"""Where a pipeline's checkpoint objects live inside a store.

::

    <prefix>manifests/<id:020d>.json                       commit points, one per checkpoint
    <prefix>state/<id:020d>/<instance:05d>-<attempt>.arrow  one state file per instance

Zero-padded ids make a plain sorted listing chronological. ``attempt`` is random per
write, so a retried or racing attempt never overwrites a file a manifest may reference.
"""

from __future__ import annotations

import dataclasses
import re
import uuid

from microbatch.errors import CheckpointError

_MANIFEST = re.compile(r"manifests/(\d{20})\.json$")
_STATE = re.compile(r"state/(\d{20})/\d{5}-[0-9a-f]+\.arrow$")


@dataclasses.dataclass(frozen=True)
class Layout:
    """Key naming under ``prefix`` ('' or ending with '/')."""

    prefix: str = ""

    def __post_init__(self) -> None:
        if self.prefix and not self.prefix.endswith("/"):
            object.__setattr__(self, "prefix", self.prefix + "/")

    @property
    def manifests(self) -> str:
        return f"{self.prefix}manifests/"

    @property
    def state(self) -> str:
        return f"{self.prefix}state/"

    def manifest_key(self, checkpoint_id: int) -> str:
        return f"{self.manifests}{check_checkpoint_id(checkpoint_id):020d}.json"

    def state_key(self, checkpoint_id: int, instance: int, attempt: str | None = None) -> str:
        attempt = attempt or uuid.uuid4().hex[:12]
        return (
            f"{self.state}{check_checkpoint_id(checkpoint_id):020d}/{instance:05d}-{attempt}.arrow"
        )

    def manifest_id(self, key: str) -> int | None:
        """The checkpoint id of a manifest key, None for anything else."""
        m = _MANIFEST.search(key[len(self.prefix) :])
        return int(m.group(1)) if m else None

    def state_id(self, key: str) -> int | None:
        """The checkpoint id a state file was written for, None for anything else."""
        m = _STATE.search(key[len(self.prefix) :])
        return int(m.group(1)) if m else None


def check_checkpoint_id(checkpoint_id: int) -> int:
    if (
        not isinstance(checkpoint_id, int)
        or isinstance(checkpoint_id, bool)
        or not (0 <= checkpoint_id < 10**20)
    ):
        raise CheckpointError(f"checkpoint id must be an int in 0..10^20-1: {checkpoint_id!r}")
    return checkpoint_id
