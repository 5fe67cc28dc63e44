"""State inspection: list checkpoints, describe a manifest, read one key's state."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from microbatch.checkpoint.catalog import latest_manifest, load_manifest
from microbatch.checkpoint.layout import Layout
from microbatch.checkpoint.manifest import Manifest
from microbatch.checkpoint.restore import instance_runs, restore_groups
from microbatch.errors import CheckpointError
from microbatch.keygroups import (
    Key,
    KeyGroupRange,
    encode_key,
    key_group,
    key_group_range,
    operator_index,
)
from microbatch.state.backend import KeyedStateBackend
from microbatch.state.engine import BlockCache, Loaded, load_keys
from microbatch.storage import ObjectStore


def describe_checkpoint(store: ObjectStore, layout: Layout, checkpoint_id: int) -> dict[str, Any]:
    """Parallelism, totals, per-instance and per-key-group sizes of one checkpoint."""
    m = load_manifest(store, layout, checkpoint_id)
    body = _describe_runs(m) if m.runs is not None else _describe_files(m)
    return {
        "checkpoint_id": m.checkpoint_id,
        "pipeline_fingerprint": m.pipeline_fingerprint,
        "created_at": m.created_at,
        "max_parallelism": m.max_parallelism,
        "parallelism": m.parallelism,
        "full_checkpoint_id": m.full_checkpoint_id,
        "total_bytes": m.total_bytes,
        "total_keys": m.total_keys,
        "files": len(m.files()),
        **body,
        "steps": {
            uid: {
                "keys": sum(op.key_counts),
                "bytes": sum({r.data: r.bytes for r in op.runs}.values()),
                "runs": len(op.runs),
                "process": op.process,
            }
            for uid, op in m.operators.items()
        },
        "metadata": dict(m.metadata),
    }


def _describe_files(m: Manifest) -> dict[str, Any]:
    """Format 1: sizes per key-group from the manifest's byte ranges."""
    groups = [
        {
            "key_group": kg,
            "bytes": e.length,
            "rows": e.rows,
            "keys": e.keys,
            "file": e.file,
            "written_by": e.checkpoint_id,
        }
        for kg, e in enumerate(m.key_groups)
        if e is not None
    ]
    instances = []
    for i in range(m.parallelism):
        r = key_group_range(m.max_parallelism, m.parallelism, i)
        own = [m.key_groups[kg] for kg in r if m.key_groups[kg] is not None]
        instances.append(
            {
                "index": i,
                "key_groups": str(r),
                "bytes": sum(e.length for e in own),
                "keys": sum(e.keys for e in own),
            }
        )
    return {
        "written_now_bytes": sum(g["bytes"] for g in groups if g["written_by"] == m.checkpoint_id),
        "instances": instances,
        "key_groups": groups,
    }


def _describe_runs(m: Manifest) -> dict[str, Any]:
    """Sorted runs: keys per key-group come from the manifest's counts, bytes per instance
    are those of the runs serving it (a run shared by instances after a rescale counts for
    each)."""
    counts = m.key_counts or ()
    runs = m.runs or ()
    instances = []
    for i in range(m.parallelism):
        r = key_group_range(m.max_parallelism, m.parallelism, i)
        serving = [ref for ref in runs if ref.clipped(r.start, r.end) is not None]
        instances.append(
            {
                "index": i,
                "key_groups": str(r),
                "bytes": sum({ref.data: ref.bytes for ref in serving}.values()),
                "keys": sum(counts[kg] for kg in r),
                "runs": len(serving),
            }
        )
    written = {r.data: r.bytes for r in runs if Layout().state_id(r.data) == m.checkpoint_id}
    return {
        "written_now_bytes": sum(written.values()),
        "instances": instances,
        "key_groups": [{"key_group": kg, "keys": n} for kg, n in enumerate(counts) if n],
        "runs": [r.to_json() for r in runs],
    }


def format_description(desc: dict[str, Any]) -> str:
    """A short human-readable summary of :func:`describe_checkpoint`."""
    lines = [
        f"checkpoint {desc['checkpoint_id']}  fingerprint {desc['pipeline_fingerprint']}  "
        f"created {desc['created_at']}",
        f"max_parallelism {desc['max_parallelism']}  parallelism {desc['parallelism']}  "
        f"last full {desc['full_checkpoint_id']}  files {desc['files']}",
        f"total {desc['total_keys']} keys, {desc['total_bytes']} bytes "
        f"({desc['written_now_bytes']} written by this checkpoint)",
        f"{'instance':>8} {'key-groups':>12} {'keys':>10} {'bytes':>12}",
    ]
    lines += [
        f"{i['index']:>8} {i['key_groups']:>12} {i['keys']:>10} {i['bytes']:>12}"
        for i in desc["instances"]
    ]
    lines += [
        f"step {uid}: {s['keys']} keys, {s['bytes']} bytes in {s['runs']} runs ({s['process']})"
        for uid, s in desc.get("steps", {}).items()
    ]
    return "\n".join(lines)


def read_key_state(
    store: ObjectStore, layout: Layout, key: Key, checkpoint_id: int | None = None
) -> dict[str, Any]:
    """Every state (and timer) of ``key`` in a checkpoint (default: the latest).

    Reads one byte range (format 1: the key's key-group) or, with sorted runs, only the
    blocks that may hold the key, newest run first. Expired TTL entries are included,
    since "expired" depends on the reader's clock.
    """
    return dict(inspect_key(store, layout, key, checkpoint_id).state)


@dataclasses.dataclass(frozen=True)
class KeyState:
    """One key's state in one checkpoint, and where it is kept: what ``microbatch state``
    shows, and what it names when the key has none."""

    key: Key
    checkpoint_id: int
    key_group: int
    max_parallelism: int
    parallelism: int
    #: What :func:`read_key_state` returns: state name → value, of every operator, and
    #: ``"timers"`` (epoch ms) if the key has any.
    state: Mapping[str, Any]

    @property
    def values(self) -> dict[str, Any]:
        """The key's states, without its timers."""
        return {name: v for name, v in self.state.items() if name != "timers"}

    @property
    def timers(self) -> list[int]:
        """The key's timers, epoch ms."""
        return list(self.state.get("timers", ()))

    @property
    def instance(self) -> int:
        """The operator instance that owns the key's key-group at the checkpoint's
        parallelism."""
        return operator_index(self.key_group, self.max_parallelism, self.parallelism)

    @property
    def empty(self) -> bool:
        return not self.state


def inspect_key(
    store: ObjectStore,
    layout: Layout,
    key: Key,
    checkpoint_id: int | None = None,
    step: str | None = None,
) -> KeyState:
    """:func:`read_key_state` with the checkpoint and key-group it read (see there);
    ``step``: the uid of a dataflow's further keyed step whose state to read (default:
    the first step's)."""
    if checkpoint_id is None:
        manifest = latest_manifest(store, layout)
        if manifest is None:
            raise CheckpointError(f"no committed checkpoint under {store.url}/{layout.prefix}")
    else:
        manifest = load_manifest(store, layout, checkpoint_id)
    if step is not None and step != manifest.first_uid:
        manifest = manifest.for_operator(step)
    kg = key_group(key, manifest.max_parallelism)
    own = KeyGroupRange(kg, kg)
    backend = KeyedStateBackend(manifest.max_parallelism, own)
    if manifest.runs is None:
        restore_groups(store, manifest, backend, [kg])
    else:
        runs = instance_runs(manifest, own)
        load_keys(BlockCache(store), runs, backend, [encode_key(key)], Loaded())
    return KeyState(
        key=key,
        checkpoint_id=manifest.checkpoint_id,
        key_group=kg,
        max_parallelism=manifest.max_parallelism,
        parallelism=manifest.parallelism,
        state=backend.describe_key(key, include_expired=True),
    )
