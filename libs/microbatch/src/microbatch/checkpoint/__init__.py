"""Checkpoints as a whole: layout, manifests, the commit protocol, restore, GC, reshard,
inspection. The state inside them — sorted runs — is the state engine's
(:mod:`microbatch.state.engine`), which this package calls and which never calls back."""

from microbatch.checkpoint.catalog import latest_manifest, list_checkpoints, load_manifest
from microbatch.checkpoint.gc import GcResult, collect_garbage
from microbatch.checkpoint.inspection import describe_checkpoint, format_description, read_key_state
from microbatch.checkpoint.layout import Layout
from microbatch.checkpoint.manifest import KeyGroupEntry, Manifest, OperatorState
from microbatch.checkpoint.reshard import ReshardResult, reshard
from microbatch.checkpoint.restore import RestoreStats, empty_backends, restore_instance
from microbatch.checkpoint.writer import (
    InstanceSnapshot,
    build_manifest,
    checkpoint,
    commit_manifest,
    write_instance_run,
)

__all__ = [
    "GcResult",
    "InstanceSnapshot",
    "KeyGroupEntry",
    "Layout",
    "Manifest",
    "OperatorState",
    "ReshardResult",
    "RestoreStats",
    "build_manifest",
    "checkpoint",
    "collect_garbage",
    "commit_manifest",
    "describe_checkpoint",
    "empty_backends",
    "format_description",
    "latest_manifest",
    "list_checkpoints",
    "load_manifest",
    "read_key_state",
    "reshard",
    "restore_instance",
    "write_instance_run",
]
