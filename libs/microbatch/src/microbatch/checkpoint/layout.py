"""Where a pipeline's objects live inside its checkpoint store: the one owner of every key.

::

    <prefix>manifests/<id:020d>.json                       commit points, one per checkpoint
    <prefix>manifests/floor-<id:020d>                      retention removed every id below
    <prefix>pins/<copy:020d>-<source:020d>-<token>         a rewind copying a checkpoint
    <prefix>state/<id:020d>/<instance:05d>-<attempt>.run.arrow    an instance's run of a batch
    <prefix>state/<id:020d>/<instance:05d>-<attempt>.index.arrow  ... and its block index
    <prefix>state/<id:020d>/<instance:05d>-<attempt>.arrow  a state file (format 1)
    <prefix>plans/<id:020d>.json                           the offset ranges a batch reads
    <prefix>batches/<id:020d>.json                         the batch's run spec (parallelism)
    <prefix>pending/<id:020d>-<attempt>.arrow              enrichment inputs left unfinished
    <prefix>staging/<id:020d>/<sink>/part-<instance:05d>-<attempt>.arrow  Kafka output, staged
    <prefix>published/<id:020d>                            the batch's output is visible
    <prefix>lease.json                                     which run works on the pipeline

Zero-padded ids make a plain sorted listing chronological. ``attempt`` is random per
attempt of a batch, so a retried, racing or stalled (zombie) attempt never overwrites a
file a manifest may reference: the manifest names the files of the attempt that committed.

A retention floor sits next to the manifests, so the one listing that finds the
checkpoints also finds it: a manifest below the floor is one retention removed, or one a
stalled attempt created after that (never a committed checkpoint). A pin says a rewind is
copying checkpoint ``source`` as checkpoint ``copy``, for GC (:mod:`.gc`).
"""

from __future__ import annotations

import dataclasses
import re
import uuid

from microbatch.errors import CheckpointError

_MANIFEST = re.compile(r"manifests/(\d{20})\.json$")
#: A format-1 state file, or a run's data (``.run.arrow``) or index (``.index.arrow``).
_FLOOR = re.compile(r"manifests/floor-(\d{20})$")
_PIN = re.compile(r"pins/(\d{20})-\d{20}-[0-9a-f]+$")
_STATE = re.compile(r"state/(\d{20})/\d{5}-[0-9a-f]+(\.run|\.index)?\.arrow$")


@dataclasses.dataclass(frozen=True)
class Layout:
    """Key naming under ``prefix`` ('' or ending with '/')."""

    prefix: str = ""

    def __post_init__(self) -> None:
        if self.prefix and not self.prefix.endswith("/"):
            object.__setattr__(self, "prefix", self.prefix + "/")

    # Checkpoints: manifests and state files ------------------------------------------
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

    def floor_key(self, first_retained: int) -> str:
        """The retention floor: every checkpoint below ``first_retained`` is removed."""
        return f"{self.manifests}floor-{check_checkpoint_id(first_retained):020d}"

    def floor_id(self, key: str) -> int | None:
        """The first retained id a retention floor key names, None for anything else."""
        m = _FLOOR.search(key[len(self.prefix) :])
        return int(m.group(1)) if m else None

    @property
    def pins(self) -> str:
        return f"{self.prefix}pins/"

    def pin_key(self, copy_id: int, source_id: int, token: str) -> str:
        """A rewind's pin: it is copying checkpoint ``source_id`` as ``copy_id``."""
        copy_id, source_id = check_checkpoint_id(copy_id), check_checkpoint_id(source_id)
        return f"{self.pins}{copy_id:020d}-{source_id:020d}-{token}"

    def pin_copy_id(self, key: str) -> int | None:
        """The checkpoint id a pinning rewind is to commit, None for anything else."""
        m = _PIN.search(key[len(self.prefix) :])
        return int(m.group(1)) if m else None

    def state_id(self, key: str) -> int | None:
        """The checkpoint id a state file was written for, None for anything else."""
        m = _STATE.search(key[len(self.prefix) :])
        return int(m.group(1)) if m else None

    # The batch protocol's objects, one per batch -------------------------------------
    @property
    def plans(self) -> str:
        return f"{self.prefix}plans/"

    @property
    def specs(self) -> str:
        return f"{self.prefix}batches/"

    @property
    def pending(self) -> str:
        return f"{self.prefix}pending/"

    @property
    def staging(self) -> str:
        return f"{self.prefix}staging/"

    @property
    def published(self) -> str:
        return f"{self.prefix}published/"

    @property
    def lease_key(self) -> str:
        return f"{self.prefix}lease.json"

    def plan_key(self, batch_id: int) -> str:
        return f"{self.plans}{check_checkpoint_id(batch_id):020d}.json"

    def spec_key(self, batch_id: int) -> str:
        return f"{self.specs}{check_checkpoint_id(batch_id):020d}.json"

    def pending_key(self, batch_id: int, attempt: str) -> str:
        return f"{self.pending}{check_checkpoint_id(batch_id):020d}-{attempt}.arrow"

    def published_key(self, batch_id: int) -> str:
        return f"{self.published}{check_checkpoint_id(batch_id):020d}"

    def staging_dir(self, batch_id: int) -> str:
        return f"{self.staging}{check_checkpoint_id(batch_id):020d}/"

    def staging_key(self, batch_id: int, sink: str, instance: int, attempt: str) -> str:
        return f"{self.staging_dir(batch_id)}{sink}/part-{instance:05d}-{attempt}.arrow"

    def per_batch_prefixes(self) -> tuple[str, ...]:
        """The prefixes holding one object (or folder) per batch id, for retention."""
        return (self.specs, self.plans, self.pending, self.published, self.staging)

    def batch_of(self, key: str) -> int | None:
        """The batch id of a per-batch object's key, None for anything else."""
        for prefix in self.per_batch_prefixes():
            if key.startswith(prefix):
                head = key[len(prefix) : len(prefix) + 20]
                return int(head) if len(head) == 20 and head.isdigit() else None
        return None


def check_checkpoint_id(checkpoint_id: int) -> int:
    if (
        not isinstance(checkpoint_id, int)
        or isinstance(checkpoint_id, bool)
        or not (0 <= checkpoint_id < 10**20)
    ):
        raise CheckpointError(f"checkpoint id must be an int in 0..10^20-1: {checkpoint_id!r}")
    return checkpoint_id
