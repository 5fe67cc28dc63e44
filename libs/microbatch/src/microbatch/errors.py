"""The one exception tree of microbatch.

Every error the library raises on purpose derives from :class:`MicrobatchError`,
so callers (the CLI, the Airflow operator) can catch one type and show its message::

    MicrobatchError
    ├── ConfigError        bad settings or pipeline definition
    ├── ServiceError       a local-stack service (Kafka, SeaweedFS) failed to start/answer
    ├── StateError         keyed state, key-groups
    ├── CheckpointError    manifests, state files, commit conflicts
    ├── StorageError       object store (local filesystem or S3)
    ├── SourceError        Kafka planning and reading
    ├── EnrichmentError    async I/O operator
    ├── ProcessError       the pipeline's keyed function raised
    ├── BatchError         a batch was refused (fenced, too many dead letters, ...)
    └── SinkError          Parquet / Kafka outputs

Messages name the thing involved (pipeline, checkpoint, topic/partition, key-group,
bucket/key), show the offending value, and say what to do when there is something to do.
"""

from __future__ import annotations


class MicrobatchError(Exception):
    """Root of every error microbatch raises on purpose."""


class ConfigError(MicrobatchError):
    """A setting or a pipeline definition is invalid."""


class ServiceError(MicrobatchError):
    """A service of the local stack failed to start, stop or answer."""


class StateError(MicrobatchError):
    """Keyed state or key-group assignment is used wrongly."""


class CheckpointError(MicrobatchError):
    """A checkpoint or manifest is missing, corrupt or already committed."""


class StorageError(MicrobatchError):
    """The object store failed an operation."""


class SourceError(MicrobatchError):
    """Kafka planning or reading failed."""


class EnrichmentError(MicrobatchError):
    """The async I/O operator failed an element or a batch."""


class SinkError(MicrobatchError):
    """A sink could not stage or publish its output."""


class ProcessError(MicrobatchError):
    """The pipeline's keyed process function raised (``on_process_error='fail'``)."""


class BatchError(MicrobatchError):
    """A batch cannot run or commit: another run holds the pipeline, or it failed a check."""


def error_text(e: BaseException, limit: int = 2000) -> str:
    """An exception as one short line (its type and message, no traceback), for a dead
    letter's ``error`` or an error message about user code."""
    import traceback

    return "".join(traceback.format_exception_only(type(e), e)).strip()[:limit]
