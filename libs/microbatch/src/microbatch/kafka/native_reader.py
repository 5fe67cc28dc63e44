"""Read planned offset ranges with microbatch's native reader (``microbatch_native``).

The same contract, settings and Arrow batches as :mod:`microbatch.kafka.confluent_reader`
— exactly the committed records of ``[start, end)``, a deleted start is a
:class:`DataLossError`, no progress for ``poll_timeout_s`` a :class:`SourceError` — with
the loop in Rust: librdkafka's messages are copied straight into Arrow buffers (validity,
offsets, data), handed to Python once per batch. confluent-kafka spends ~2 µs of CPU per
record on its Python ``Message`` objects, librdkafka itself ~0.4
(``bench/bench_kafka_reader.py``).

The extension is ``libs/microbatch-native`` (librdkafka built from source into it, with
zlib and zstd; lz4 and snappy are librdkafka's own): ``make setup`` builds and installs it,
and the executors need it as they need microbatch. It is built without OpenSSL, so TLS and
SASL mechanisms other than PLAIN are confluent-kafka's to read (``reader="auto"`` picks
it then, :func:`native_problem`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import pyarrow as pa

from microbatch.errors import ConfigError, SourceError
from microbatch.kafka.confluent_reader import (
    CONSUME_WAIT_S,
    librdkafka_config,
    no_progress,
    problem_of,
    range_settings,
    refused_login,
)
from microbatch.kafka.offsets import OffsetRange
from microbatch.kafka.reader import HEADER_TYPE, KAFKA_SCHEMA, deleted_start
from microbatch.native_buffers import array_of

_HEADERS_TYPE = KAFKA_SCHEMA.field("headers").type
#: The most key (or value) bytes one batch can hold: ``binary``'s offsets are 32-bit.
MAX_BATCH_BYTES = 2**31 - 1
_INSTALL = (
    "build it with `make setup` (or `pip install libs/microbatch-native`, which needs "
    "cargo) on the driver and the executors, or use reader='confluent'"
)


def native_problem(config: Mapping[str, Any] | None) -> str | None:
    """Why ``KafkaSource(reader="auto")`` cannot read with the native reader here (None:
    it can): :func:`check_native`'s error."""
    return problem_of(check_native, config)


def check_native(config: Mapping[str, Any] | None) -> None:
    """Raise :class:`ConfigError` unless the extension imports and ``config`` (kafka-python
    names, ``Settings.kafka_client_config``) is one it can connect with: checked on the
    driver, so a stage-1 task never starts to fail there."""
    settings = librdkafka_config(config)
    protocol = str(settings.get("security.protocol", "PLAINTEXT")).upper()
    mechanism = str(settings.get("sasl.mechanism", "PLAIN")).upper()
    if "SSL" in protocol or (protocol.startswith("SASL") and mechanism != "PLAIN"):
        raise ConfigError(
            f"KafkaSource(reader='native') is built without TLS or SASL {mechanism} "
            f"(security protocol {protocol}): use reader='confluent' (or 'auto', which "
            "picks it)"
        )
    try:
        import microbatch_native  # noqa: F401
    except ImportError as exc:
        raise ConfigError(
            f"KafkaSource(reader='native') needs the microbatch-native extension ({exc}): "
            + _INSTALL
        ) from exc


def _text(value: Any) -> str:
    """A setting as librdkafka's text."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _binary(type_: pa.DataType, buffers: tuple[Any, ...]) -> pa.Array:
    """A binary or string array from the extension's (validity, nulls, offsets, data)."""
    validity, nulls, offsets, data = buffers
    return array_of(type_, len(offsets) // 4 - 1, data, validity, nulls, offsets)


def _batch(r: OffsetRange, buffers: tuple[Any, ...]) -> pa.RecordBatch:
    """One :data:`KAFKA_SCHEMA` batch from one ``RangeReader.next_batch``."""
    rows, keys, values, offsets, timestamps, headers = buffers
    if timestamps is None:
        times = pa.nulls(rows, pa.int64())
        all_headers = pa.nulls(rows, _HEADERS_TYPE)
    else:
        times = array_of(pa.int64(), rows, timestamps)
        list_offsets, names, contents = headers
        entries = pa.StructArray.from_arrays(
            [_binary(pa.string(), names), _binary(pa.binary(), contents)],
            fields=list(HEADER_TYPE),
        )
        starts = array_of(pa.int32(), rows + 1, list_offsets)
        all_headers = pa.ListArray.from_arrays(starts, entries, type=_HEADERS_TYPE)
    return pa.RecordBatch.from_arrays(
        [
            _binary(pa.binary(), keys),
            _binary(pa.binary(), values),
            pa.repeat(pa.scalar(r.topic, pa.string()), rows),
            pa.repeat(pa.scalar(r.partition, pa.int32()), rows),
            array_of(pa.int64(), rows, offsets),
            times,
            all_headers,
        ],
        schema=KAFKA_SCHEMA,
    )


def _failure(r: OffsetRange, where: str, waited_s: float, kind: str, message: str,
             offset: int) -> Exception:  # fmt: skip
    """The error of a read of ``r`` the extension stopped (``ReadError``'s kind, text,
    offset; ``waited_s``: the no-progress timeout)."""
    if kind == "deleted":
        return deleted_start(where, offset)
    if kind == "auth":
        return refused_login(where, message)
    if kind == "stalled":
        return no_progress(where, waited_s, offset, r.end, message)
    if kind == "config":
        return SourceError(f"reading {where}: cannot create a Kafka consumer: {message}")
    return SourceError(f"reading {where} at offset {offset}: {message}")


def read_range_native(
    bootstrap_servers: str,
    r: OffsetRange,
    *,
    batch_rows: int = 10_000,
    poll_timeout_s: float = 60.0,
    consumer_config: Mapping[str, Any] | None = None,
    source_only: bool = False,
    batch_bytes: int = MAX_BATCH_BYTES,
) -> Iterator[pa.RecordBatch]:
    """Yield the committed records of ``r`` as Arrow batches of up to ``batch_rows`` rows:
    what :func:`~microbatch.kafka.reader.read_range` yields, read by the native reader.
    ``consumer_config``: kafka-python names; ``source_only``: as ``read_range``'s. A batch
    also ends before a record that would take its keys or values past ``batch_bytes``
    (a record larger than that alone is a batch of its own)."""
    if batch_rows < 1:
        raise SourceError(f"{r.tp}: batch_rows must be ≥ 1, got {batch_rows}")
    if r.count == 0:
        return
    check_native(consumer_config)
    import microbatch_native

    where = f"{r.tp} [{r.start}, {r.end}) on {bootstrap_servers}"
    settings = range_settings(bootstrap_servers, r, librdkafka_config(consumer_config))
    try:
        reader = microbatch_native.RangeReader(
            [(name, _text(value)) for name, value in settings.items()],
            r.topic,
            r.partition,
            r.start,
            r.end,
            batch_rows,
            min(batch_bytes, MAX_BATCH_BYTES),
            poll_timeout_s,
            round(CONSUME_WAIT_S * 1000),
            source_only,
        )
    except microbatch_native.ReadError as exc:
        raise _failure(r, where, poll_timeout_s, *exc.args) from None
    try:
        while True:
            try:
                buffers = reader.next_batch()
            except microbatch_native.ReadError as exc:
                raise _failure(r, where, poll_timeout_s, *exc.args) from None
            if buffers is None:
                return
            yield _batch(r, buffers)
    finally:
        reader.close()
