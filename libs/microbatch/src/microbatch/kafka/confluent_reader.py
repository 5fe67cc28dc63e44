"""Read planned offset ranges with confluent-kafka (librdkafka, the C client).

The same contract and the same Arrow batches as :mod:`microbatch.kafka.reader`'s
kafka-python reader — exactly the committed records of ``[start, end)``, a deleted start
is a :class:`DataLossError`, no progress for ``poll_timeout_s`` a :class:`SourceError` —
for about a third of its CPU: librdkafka fetches and decompresses in C threads, Python
only builds the columns (``bench/bench_kafka_reader.py``).

How the loop knows a range is done without waiting for offsets that hold no record
(transaction markers, aborted or compacted records): ``seen``, the offset below which
every offset is accounted for, moves past each record returned, to librdkafka's
end-of-partition event (which steps over such offsets at the end of the log), and to
``end`` when a record at or past ``end`` arrives (not returned). ``consume`` is never asked
for more messages than offsets left, so a range without gaps takes nothing past its end
from librdkafka's queue, and asking for more would wait the whole call's timeout.

Settings come in kafka-python's names (``Settings.kafka_client_config``, a source's
``consumer_config``) and are mapped to librdkafka's (:func:`librdkafka_config`); one that
has no librdkafka setting of the same meaning is refused, never dropped.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import pyarrow as pa

from microbatch.errors import ConfigError, SourceError
from microbatch.kafka.offsets import OffsetRange
from microbatch.kafka.reader import build_consumer_config, deleted_start, kafka_batch

log = logging.getLogger(__name__)

#: librdkafka settings that decide *which* records are returned (as read_range's fixed
#: kafka-python ones). librdkafka wants a group.id even for ``assign``: nothing joins or
#: commits to it.
FIXED: dict[str, Any] = {
    "group.id": "microbatch-range-reader",
    "enable.auto.commit": False,
    "enable.auto.offset.store": False,
    "isolation.level": "read_committed",
    "auto.offset.reset": "error",
    "enable.partition.eof": True,
    "check.crcs": True,
}
#: Throughput defaults. librdkafka's 1 s ``fetch.queue.backoff.ms`` (how long a fetch
#: waits once the prefetch queue is full) stalls a reader that drains the queue quickly:
#: 180k records/s with it, 700-900k with 10 ms, at the same CPU. ``fetch.wait.max.ms``:
#: the ranges are already written, nothing to wait for (as the JVM reader's). A range
#: ending mid-log makes librdkafka prefetch past it: 16 MiB of queue per partition (not
#: 64) bounds that waste; the per-range ``queued.min.messages`` (see :func:`_consumer`)
#: bounds it in records. ``fetch.message.max.bytes``: librdkafka fetches a partition 1 MiB
#: a request, one request at a time (~1,600 Nexmark auctions, 1.5-10 ms a round trip on
#: loopback); 4 MiB takes a quarter of the round trips: 150k auctions 0.148 → 0.106 s,
#: 0.243 → 0.200 s with both cores busy, at the same CPU.
DEFAULTS: dict[str, Any] = {
    "fetch.queue.backoff.ms": 10,
    "fetch.wait.max.ms": 10,
    "fetch.message.max.bytes": 4 << 20,
    "queued.max.messages.kbytes": 16 * 1024,
}
#: librdkafka's default of how many messages it keeps prefetched per partition.
_QUEUED_MIN_MESSAGES = 100_000
#: How long one ``consume`` call waits for all the messages it asked for before returning
#: those that came; a range ending in offsets without records at the log's end waits it once.
CONSUME_WAIT_S = 0.05

#: librdkafka's default message.max.bytes.
_MESSAGE_MAX_BYTES = 1_000_000
#: kafka-python name → librdkafka name, where the meaning is the same.
_NAMES: dict[str, str] = {
    "client_id": "client.id",
    "client_rack": "client.rack",
    "connections_max_idle_ms": "connections.max.idle.ms",
    "fetch_max_bytes": "fetch.max.bytes",
    "fetch_max_wait_ms": "fetch.wait.max.ms",
    "fetch_min_bytes": "fetch.min.bytes",
    "max_partition_fetch_bytes": "max.partition.fetch.bytes",
    "metadata_max_age_ms": "metadata.max.age.ms",
    "receive_buffer_bytes": "socket.receive.buffer.bytes",
    "reconnect_backoff_max_ms": "reconnect.backoff.max.ms",
    "reconnect_backoff_ms": "reconnect.backoff.ms",
    # librdkafka's timeout of a network request (Java's request.timeout.ms).
    "request_timeout_ms": "socket.timeout.ms",
    "retry_backoff_ms": "retry.backoff.ms",
    "send_buffer_bytes": "socket.send.buffer.bytes",
    "socket_connection_setup_timeout_ms": "socket.connection.setup.timeout.ms",
    "security_protocol": "security.protocol",
    "sasl_mechanism": "sasl.mechanism",
    "sasl_plain_username": "sasl.username",
    "sasl_plain_password": "sasl.password",
    "sasl_kerberos_service_name": "sasl.kerberos.service.name",
    "ssl_cafile": "ssl.ca.location",
    "ssl_certfile": "ssl.certificate.location",
    "ssl_keyfile": "ssl.key.location",
    "ssl_password": "ssl.key.password",
    "ssl_crlfile": "ssl.crl.location",
    "ssl_ciphers": "ssl.cipher.suites",
}
#: kafka-python settings the readers fix; unchanged, the fixed librdkafka ones stand in.
_FIXED_KAFKA_PYTHON = ("enable_auto_commit", "isolation_level", "auto_offset_reset",
                       "group_id", "check_crcs")  # fmt: skip
_PERMANENT_ERRORS = (
    "_UNKNOWN_PARTITION",
    "_UNKNOWN_TOPIC",
    "UNKNOWN_TOPIC_OR_PART",
    "TOPIC_AUTHORIZATION_FAILED",
)
#: Errors that retrying will not fix: a wrong user or password (SSL ones may be transient).
_AUTH_ERRORS = ("_AUTHENTICATION", "SASL_AUTHENTICATION_FAILED")


def unmapped_settings(config: Mapping[str, Any]) -> list[str]:
    """The kafka-python settings in ``config`` that have no librdkafka setting of the same
    meaning (sorted)."""
    mapped = {*_NAMES, "ssl_check_hostname", "bootstrap_servers", *_FIXED_KAFKA_PYTHON}
    return sorted(name for name in config if name not in mapped)


def confluent_problem(config: Mapping[str, Any] | None) -> str | None:
    """Why ``KafkaSource(reader="auto")`` cannot read with confluent-kafka here (None: it
    can): :func:`check_confluent`'s error. The executors run the same environment as the
    driver (confluent-kafka is one of microbatch's dependencies)."""
    return problem_of(check_confluent, config)


def problem_of(check: Callable[[Mapping[str, Any] | None], None],
               config: Mapping[str, Any] | None) -> str | None:  # fmt: skip
    """``check(config)``'s :class:`ConfigError` as text; None when it passes."""
    try:
        check(config)
    except ConfigError as exc:
        return str(exc)
    return None


def refused_login(where: str, reason: str) -> SourceError:
    """The error of a range whose broker refused the client's credentials (either
    librdkafka reader), saying what to check."""
    return SourceError(
        f"reading {where}: the broker refused the connection ({reason}). "
        "Check MICROBATCH_KAFKA_SECURITY_PROTOCOL, MICROBATCH_KAFKA_SASL_* and "
        "MICROBATCH_KAFKA_SSL_CAFILE (or the Airflow connection)."
    )


def no_progress(where: str, waited_s: float, offset: int, end: int, last: str) -> SourceError:
    """The error of a range whose read stalled at ``offset`` for ``waited_s`` (``last``:
    the client's last error, if any)."""
    return SourceError(
        f"reading {where}: no progress for {waited_s:.0f} s at offset {offset} (wanted up "
        f"to {end}). Is the broker reachable, and was the range planned against this "
        f"cluster's end offsets?{f' Last client error: {last}.' if last else ''}"
    )


def check_confluent(config: Mapping[str, Any] | None) -> None:
    """Raise :class:`ConfigError` unless confluent-kafka imports and ``config`` (kafka-python
    names, ``Settings.kafka_client_config``) maps to librdkafka's settings: checked on the
    driver, so a stage-1 task never starts to fail there."""
    librdkafka_config(config)
    try:
        import confluent_kafka  # noqa: F401
    except ImportError as exc:
        raise ConfigError(
            "KafkaSource(reader='confluent') needs the confluent-kafka package on the "
            f"driver and the executors ({exc}): pip install confluent-kafka (or use "
            "reader='python' or 'spark')"
        ) from exc


def librdkafka_config(config: Mapping[str, Any] | None, *, where: str = "") -> dict[str, Any]:
    """librdkafka settings for kafka-python ones (``Settings.kafka_client_config``, a
    source's ``consumer_config``). Fixed settings may not change (the rule and error of
    :func:`~microbatch.kafka.reader.build_consumer_config`); a setting librdkafka has no
    equivalent of raises :class:`ConfigError` naming it and the reader."""
    given = dict(config or {})
    build_consumer_config("-", given)  # refuses changes to the fixed settings
    unmapped = unmapped_settings(given)
    if unmapped:
        raise ConfigError(
            f"{where + ': ' if where else ''}consumer setting(s) {unmapped} have no "
            "librdkafka setting of the same meaning, so KafkaSource(reader='confluent') "
            f"cannot take them (it maps {', '.join(sorted(_NAMES))} and ssl_check_hostname). "
            "Remove them, or read with reader='python' or 'spark'."
        )
    out: dict[str, Any] = {}
    for name, value in given.items():
        if name in _NAMES:
            out[_NAMES[name]] = value
        elif name == "ssl_check_hostname":
            out["ssl.endpoint.identification.algorithm"] = "https" if value else "none"
        elif name == "bootstrap_servers":
            out["bootstrap.servers"] = value
    fetch_max = out.get("fetch.max.bytes")
    if isinstance(fetch_max, int) and fetch_max < _MESSAGE_MAX_BYTES:
        # librdkafka refuses fetch.max.bytes below message.max.bytes, a producer's limit
        # that a consumer does not use (Java's fetch.max.bytes has no such floor).
        out["message.max.bytes"] = max(1000, fetch_max)
    return out


def range_settings(bootstrap_servers: str, r: OffsetRange,
                   config: Mapping[str, Any]) -> dict[str, Any]:  # fmt: skip
    """librdkafka's settings for reading ``r`` (``config``: :func:`librdkafka_config`'s):
    prefetching at most about as many records as it holds; the fixed ones win."""
    return {
        **DEFAULTS,
        "queued.min.messages": max(1, min(_QUEUED_MIN_MESSAGES, r.count)),
        **config,
        "bootstrap.servers": bootstrap_servers,
        **FIXED,
    }


def _consumer(bootstrap_servers: str, r: OffsetRange, config: Mapping[str, Any],
              errors: list[Any]) -> Any:  # fmt: skip
    """A consumer for ``r`` (:func:`range_settings`), its client errors into ``errors``."""
    from confluent_kafka import Consumer

    settings = range_settings(bootstrap_servers, r, config)
    return Consumer({**settings, "error_cb": errors.append, "logger": log})


def _batch(topic: str, partition: int, records: list[Any], source_only: bool) -> pa.RecordBatch:
    """One ``KAFKA_SCHEMA`` batch from confluent-kafka ``Message``s: whole columns at once
    (``source_only``: no timestamps or headers taken)."""
    from confluent_kafka import Message

    timestamps: list[int] | None = None
    headers: list[Any] | None = None
    if not source_only:
        timestamps = [ts for _, ts in map(Message.timestamp, records)]
        headers = list(map(Message.headers, records))  # None, not [], without headers
        if any(headers):
            headers = [h or [] for h in headers]
    return kafka_batch(
        topic,
        partition,
        list(map(Message.key, records)),
        list(map(Message.value, records)),
        list(map(Message.offset, records)),
        timestamps,
        headers,
    )


def read_range_confluent(
    bootstrap_servers: str,
    r: OffsetRange,
    *,
    batch_rows: int = 10_000,
    poll_timeout_s: float = 60.0,
    consumer_config: Mapping[str, Any] | None = None,
    source_only: bool = False,
) -> Iterator[pa.RecordBatch]:
    """Yield the committed records of ``r`` as Arrow batches of up to ``batch_rows`` rows:
    what :func:`~microbatch.kafka.reader.read_range` yields, read by confluent-kafka.
    ``consumer_config``: kafka-python names (:func:`librdkafka_config`); ``source_only``:
    as ``read_range``'s."""
    from confluent_kafka import KafkaError, KafkaException, TopicPartition

    if batch_rows < 1:
        raise SourceError(f"{r.tp}: batch_rows must be ≥ 1, got {batch_rows}")
    if r.count == 0:
        return
    where = f"{r.tp} [{r.start}, {r.end}) on {bootstrap_servers}"
    config = librdkafka_config(consumer_config)
    permanent = {getattr(KafkaError, name) for name in _PERMANENT_ERRORS}
    auth = {getattr(KafkaError, name) for name in _AUTH_ERRORS}
    client_errors: list[Any] = []  # from librdkafka's error callback, during consume
    try:
        consumer = _consumer(bootstrap_servers, r, config, client_errors)
    except KafkaException as exc:
        raise SourceError(f"reading {where}: cannot create a Kafka consumer: {exc}") from exc
    pending: list[Any] = []
    try:
        consumer.assign([TopicPartition(r.topic, r.partition, r.start)])
        seen = r.start
        last_progress = time.monotonic()
        while seen < r.end:
            before = seen
            wanted = min(batch_rows - len(pending), r.end - seen)
            records = consumer.consume(num_messages=wanted, timeout=CONSUME_WAIT_S)
            if any(m.error() is not None for m in records):
                events, records = records, []
                for m in events:
                    error = m.error()
                    if error is None:
                        records.append(m)
                    elif error.code() == KafkaError._PARTITION_EOF:
                        seen = max(seen, m.offset())
                    elif error.code() == KafkaError._AUTO_OFFSET_RESET:
                        raise deleted_start(where, seen)
                    elif error.fatal() or error.code() in permanent:
                        raise SourceError(f"reading {where} at offset {seen}: {error.str()}")
                    # else transient (a lost broker connection): librdkafka retries it
            if records:
                if records[-1].offset() >= r.end:
                    records = [m for m in records if m.offset() < r.end]
                    seen = r.end
                if records:
                    seen = max(seen, records[-1].offset() + 1)
                    pending.extend(records)
                    if len(pending) >= batch_rows:
                        batch, pending = _batch(r.topic, r.partition, pending, source_only), []
                        yield batch  # the messages freed first: see microbatch.gcpause
            failed = [e for e in client_errors if e.code() in auth]
            if failed:
                raise refused_login(where, failed[0].str())
            if seen > before:
                last_progress = time.monotonic()
            elif time.monotonic() - last_progress > poll_timeout_s:
                last = client_errors[-1].str() if client_errors else ""
                raise no_progress(where, poll_timeout_s, seen, r.end, last)
        if pending:
            yield _batch(r.topic, r.partition, pending, source_only)
    finally:
        consumer.close()
