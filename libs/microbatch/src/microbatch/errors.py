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
    │   └── DataLossError  records a batch must read were deleted (topic retention)
    ├── EnrichmentError    async I/O operator
    ├── ProcessError       the pipeline's keyed function raised
    ├── BatchError         a batch was refused (too many dead letters, ...)
    │   └── LeaseError     another run holds the pipeline's lease, or took it over
    ├── SinkError          Parquet / Kafka outputs
    └── NotFoundError      what a command was asked to show does not exist

Messages name the thing involved (pipeline, checkpoint, topic/partition, key-group,
bucket/key), show the offending value, and say what to do when there is something to do.

How a process reports an error to its caller is decided in one place, :func:`exit_code`:
every failure maps to one :class:`ExitCode` (the ``microbatch`` command's exit status and
the ``reason`` of its ``--json`` error object), which the Airflow operator acts on.
"""

from __future__ import annotations

import enum
import re


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


class DataLossError(SourceError):
    """Records a batch must read are gone from Kafka (retention deleted them): rerunning the
    same plan cannot succeed; the message says how to go on without them."""


class EnrichmentError(MicrobatchError):
    """The async I/O operator failed an element or a batch."""


class SinkError(MicrobatchError):
    """A sink could not stage or publish its output."""


class NotFoundError(MicrobatchError):
    """What a command was asked to show does not exist (a key without state, a checkpoint
    that is not retained): the command exits ``not_found``."""


class ProcessError(MicrobatchError):
    """The pipeline's keyed process function raised (``on_process_error='fail'``)."""


class BatchError(MicrobatchError):
    """A batch cannot run or commit: another run holds the pipeline, or it failed a check."""


class LeaseError(BatchError):
    """Another run holds the pipeline's lease, or took it over from this run (fenced): the
    batch may run once that run has finished or its lease has expired."""


def error_text(e: BaseException, limit: int = 2000) -> str:
    """An exception as one short line (its type and message, no traceback), for a dead
    letter's ``error`` or an error message about user code."""
    import traceback

    return "".join(traceback.format_exception_only(type(e), e)).strip()[:limit]


class ExitCode(enum.IntEnum):
    """How a ``microbatch`` process ended: its exit status, by cause (see :func:`exit_code`).

    - 0 ``ok``: the command succeeded.
    - 1 ``batch_failed``: anything else — a failed check, the pipeline's own code, an S3 or
      Kafka error that is none of the below. A scheduler retries.
    - 2 ``config_error``: :class:`ConfigError` (settings, pipeline, command line) or
      credentials S3/Kafka rejected. Retrying cannot help: fail.
    - 3 ``lease_held``: :class:`LeaseError`, another run holds the pipeline (or took it
      over from this one). Wait, then try again.
    - 4 ``service_unreachable``: Kafka, S3 or a local service did not answer (connection
      refused or timed out). Retry.
    - 5 ``data_loss``: :class:`DataLossError`, Kafka deleted records the batch must read.
      Fail; a person decides (``microbatch run --replan``).
    - 6 ``not_found``: :class:`NotFoundError`, what a command that looks things up was asked
      to show does not exist (``state`` of a key without state, a checkpoint that is not
      retained). Check the name; retrying cannot help. A batch never ends with it.

    Command-line usage errors exit 2, as argparse always has.
    """

    OK = 0
    BATCH_FAILED = 1
    CONFIG_ERROR = 2
    LEASE_HELD = 3
    SERVICE_UNREACHABLE = 4
    DATA_LOSS = 5
    NOT_FOUND = 6

    @property
    def reason(self) -> str:
        """The machine-readable name: ``lease_held``, ``config_error``, ..."""
        return self.name.lower()

    @classmethod
    def of_status(cls, status: int | None) -> ExitCode:
        """The code of a process's exit status; any other status (killed by a signal, a JVM
        that died) is :attr:`BATCH_FAILED`."""
        try:
            return cls(status)
        except ValueError:
            return cls.BATCH_FAILED


#: Error codes of S3 (and S3-compatible stores) for credentials they do not accept.
S3_CREDENTIAL_CODES = frozenset(
    {
        "AccessDenied",
        "ExpiredToken",
        "InvalidAccessKeyId",
        "InvalidClientTokenId",
        "InvalidToken",
        "SignatureDoesNotMatch",
    }
)
_QUALIFIED = re.compile(r"\bmicrobatch\.errors\.([A-Za-z]+Error)\b")
#: Refused credentials as they read in a traceback Spark hands back as text: botocore's
#: "An error occurred (<code>)" with a credentials code, or the class of the cause.
_REJECTED_TEXT = re.compile(
    r"An error occurred \((?:" + "|".join(sorted(S3_CREDENTIAL_CODES)) + r")\)"
    r"|\bbotocore\.exceptions\.(?:NoCredentialsError|PartialCredentialsError)\b"
    r"|Unable to locate credentials"
    r"|\bkafka\.errors\.(?:SaslAuthenticationFailedError|\w+AuthorizationFailedError)\b"
)
#: A failed connection as it reads in a traceback Spark hands back as text: the class of
#: the cause (the worker's traceback names it) or, where only the library's own line came
#: through, the words botocore uses for it in the message a StorageError repeats.
_UNREACHABLE_TEXT = re.compile(
    r"\bbotocore\.exceptions\.(?:EndpointConnectionError|ConnectTimeoutError|ConnectionError"
    r"|ProxyConnectionError)\b"
    r"|\bkafka\.errors\.(?:KafkaConnectionError|KafkaTimeoutError|NoBrokersAvailable)\b"
    r"|\b(?:ConnectionRefusedError|ConnectionResetError|ConnectionAbortedError)\b"
    r"|Could not connect to the endpoint URL|Connect timeout on endpoint URL"
)


def exit_code(error: BaseException) -> ExitCode:
    """The :class:`ExitCode` of ``error``: the one mapping from failures to exit statuses.

    By the library's error class first (also when Spark hands it back as text: an error
    raised in a Spark task reaches the driver as a Java/Python exception whose message
    names ``microbatch.errors.<Class>``), then by what caused it: a connection that
    failed (``ConnectionError``, botocore's ``EndpointConnectionError``, kafka-python's
    ``KafkaConnectionError``/``KafkaTimeoutError``) is ``SERVICE_UNREACHABLE`` — also
    when a Spark task's library error arrives as text naming such a cause (S3 unreachable
    from an executor exits as it does on the driver); credentials S3 or Kafka refused are
    ``CONFIG_ERROR``; anything else ``BATCH_FAILED``.
    """
    own = library_error_class(error)
    if own is not None:
        for cls, code in (
            (NotFoundError, ExitCode.NOT_FOUND),
            (LeaseError, ExitCode.LEASE_HELD),
            (DataLossError, ExitCode.DATA_LOSS),
            (ConfigError, ExitCode.CONFIG_ERROR),
            (ServiceError, ExitCode.SERVICE_UNREACHABLE),
        ):
            if issubclass(own, cls):
                return code
    for cause in _chain(error):
        if _rejects_credentials(cause) or _reads_rejected_credentials(cause):
            return ExitCode.CONFIG_ERROR
        if _is_unreachable(cause) or _reads_unreachable(cause):
            return ExitCode.SERVICE_UNREACHABLE
    return ExitCode.BATCH_FAILED


def library_error_class(error: BaseException) -> type[MicrobatchError] | None:
    """``error``'s class if microbatch raised it, else the ``microbatch.errors`` class its
    message names last (the outermost one of a traceback Spark passed on as text)."""
    if isinstance(error, MicrobatchError):
        return type(error)
    for name in reversed(_QUALIFIED.findall(str(error))):
        cls = globals().get(name)
        if isinstance(cls, type) and issubclass(cls, MicrobatchError):
            return cls
    return None


def _chain(error: BaseException) -> list[BaseException]:
    """``error`` and every exception it was raised from or while handling."""
    seen: list[BaseException] = []
    pending: list[BaseException | None] = [error]
    while pending:
        e = pending.pop()
        if e is None or any(e is s for s in seen):
            continue
        seen.append(e)
        pending += [e.__context__, e.__cause__]
    return seen


def _classes(module: str, *names: str) -> tuple[type, ...]:
    """The named exception classes of ``module`` if it is loaded (an error of a module
    that was never imported cannot have been raised), without importing it."""
    import sys

    loaded = sys.modules.get(module)
    found = (getattr(loaded, name, None) for name in names)
    return tuple(c for c in found if isinstance(c, type))


def _is_unreachable(e: BaseException) -> bool:
    return isinstance(
        e,
        (
            ConnectionError,
            *_classes("botocore.exceptions", "ConnectionError"),
            *_classes(
                "kafka.errors", "KafkaConnectionError", "KafkaTimeoutError", "NoBrokersAvailable"
            ),
        ),
    )


def _reads_unreachable(e: BaseException) -> bool:
    """A library error passed on as text (a Spark task's) whose cause was a connection
    that failed: the text names both."""
    if isinstance(e, MicrobatchError) or library_error_class(e) is None:
        return False
    return _UNREACHABLE_TEXT.search(str(e)) is not None


def _reads_rejected_credentials(e: BaseException) -> bool:
    """A library error passed on as text (a Spark task's) whose cause was credentials S3
    or Kafka refused: the text names the cause's class or S3's error code."""
    if isinstance(e, MicrobatchError) or library_error_class(e) is None:
        return False
    return _REJECTED_TEXT.search(str(e)) is not None


def _rejects_credentials(e: BaseException) -> bool:
    refused = _classes(
        "botocore.exceptions", "NoCredentialsError", "PartialCredentialsError"
    ) + _classes(
        "kafka.errors",
        "SaslAuthenticationFailedError",
        "ClusterAuthorizationFailedError",
        "TopicAuthorizationFailedError",
        "GroupAuthorizationFailedError",
        "TransactionalIdAuthorizationFailedError",
    )
    if isinstance(e, refused):
        return True
    client_error = _classes("botocore.exceptions", "ClientError")
    if client_error and isinstance(e, client_error):
        code = (getattr(e, "response", None) or {}).get("Error", {}).get("Code", "")
        return code in S3_CREDENTIAL_CODES
    return False
