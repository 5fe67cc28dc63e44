"""microbatch's native Kafka range reader (``libs/microbatch-native/src/lib.rs``)."""

from typing import Any

class ReadError(Exception):
    """A range could not be read: args are (kind, message, offset)."""

class RangeReader:
    def __init__(
        self,
        config: list[tuple[str, str]],
        topic: str,
        partition: int,
        start: int,
        end: int,
        batch_rows: int,
        batch_bytes: int,
        poll_timeout_s: float,
        wait_ms: int,
        source_only: bool,
    ) -> None: ...
    def next_batch(self) -> tuple[Any, ...] | None: ...
    def close(self) -> None: ...
    @property
    def seen(self) -> int: ...

def librdkafka_version() -> str: ...
def decode_json(
    offsets: Any,
    data: Any,
    names: list[str],
    kinds: list[int],
    nullable: list[bool],
    keep: list[bool],
) -> tuple[bytes, list[tuple[Any, int, bytes, bytes | None]]]: ...
def encode_rows(
    rows: int,
    names: list[str],
    kinds: list[int],
    offsets: list[int],
    buffers: list[tuple[Any, Any, Any]],
    prefix: bytes,
) -> tuple[bytes, bytes]: ...
def decode_rows(
    offsets: Any,
    data: Any,
    prefix: bytes,
    names: list[str],
    kinds: list[int],
    nullable: list[bool],
) -> list[tuple[bytes | None, int, bytes, bytes | None]] | None: ...
def split_lists(
    offsets: Any, data: Any, prefix: bytes, flagged: bool
) -> tuple[bytes, bytes, bytes, bytes] | None: ...
def join_lists(
    offsets: Any, data: Any, prefix: bytes, counts: Any, flags: Any | None = None
) -> tuple[bytes, bytes] | None: ...
