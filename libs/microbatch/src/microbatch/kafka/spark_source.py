"""Read planned offset ranges with Spark's own Kafka batch source (the JVM connector).

:func:`read_ranges_spark` returns the rows :func:`microbatch.kafka.reader.read_ranges`
returns (``KAFKA_SCHEMA``: key, value, topic, partition, offset, timestamp in epoch ms,
headers), but the Java consumer fetches and parses the records inside the executors —
kafka-python spends 10-13 µs of Python per record on that, the JVM a fraction of it — and
Python receives them as Arrow batches. The same records, by construction:

- ``kafka.isolation.level=read_committed``: committed records only; the source steps over
  offsets it cannot see (transaction markers, aborted records, compacted records) instead
  of waiting for them, as :func:`~microbatch.kafka.reader.read_range` does;
- ``assign`` with ``startingOffsets``/``endingOffsets`` per partition from the plan: the
  exact ``[start, end)`` of every range, one Spark task per range;
- ``failOnDataLoss=true``: a start that retention deleted fails the read, never a silent
  jump. The driver checks the ranges against the broker first (:func:`check_available`)
  so the usual case fails with a message naming the partition and what to do; Spark's own
  check covers a deletion racing the read.

``consumer_config`` takes kafka-python names, like the Python reader's, and maps them to
the Java consumer's (``kafka.``-prefixed source options) where the meaning is the same;
anything else is refused with the reason, never dropped (:func:`consumer_options`).

Which reader a batch uses: :func:`choose_reader`, from ``KafkaSource(reader=...)`` and
whether the session can load the connector (:func:`connector_problem`: one probe per
session, through the DataFrame API, so it works on Spark Connect too).
"""

from __future__ import annotations

import contextlib
import json
import logging
import weakref
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal, cast

from microbatch.errors import ConfigError, DataLossError, SourceError
from microbatch.kafka.offsets import OffsetRange, TopicPartition
from microbatch.kafka.reader import KAFKA_SPARK_SCHEMA, build_consumer_config
from microbatch.settings import KAFKA_TUNABLE

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

    from microbatch.kafka.planner import BrokerView

log = logging.getLogger(__name__)

Reader = Literal["auto", "python", "spark", "confluent", "native"]
READERS: tuple[str, ...] = ("auto", "python", "spark", "confluent", "native")
#: How the connector is named in ``--packages`` (Scala 2.13 builds, as pyspark 4's).
CONNECTOR = "org.apache.spark:spark-sql-kafka-0-10_2.13"

#: Source options that decide *which* records are read; never taken from callers.
FIXED_OPTIONS: dict[str, str] = {
    "kafka.isolation.level": "read_committed",
    "includeHeaders": "true",
    "failOnDataLoss": "true",
}
_HEADERS_DDL = "array<struct<key: string, value: binary>>"
#: How long a task waits for a fetch before failing, as the Python reader's poll timeout.
POLL_TIMEOUT_MS = 60_000

#: kafka-python settings whose Java consumer setting has the same meaning and the same
#: words, joined by dots (``fetch_max_bytes`` → ``fetch.max.bytes``): those a source may
#: tune (:data:`~microbatch.settings.KAFKA_TUNABLE`), plus the deployment's.
_SAME_MEANING = KAFKA_TUNABLE | {
    "sasl_kerberos_service_name",
    "sasl_mechanism",
    "security_protocol",
    "socket_connection_setup_timeout_ms",
}
#: Consumer defaults of the JVM reader, in kafka-python names. Not the Python reader's
#: 16/64 MB fetch sizes: Spark caches each read's consumers for minutes (a new group per
#: query), each holding a prefetched fetch, and 16 MB each exhausted a 1 GB driver heap in
#: local mode after a dozen reads; with Java's 1 MB the CPU per record was the same.
#: Larger polls (as read_range's batch_rows) cost ~15 % less JVM CPU than Java's 500.
#: ``fetch_max_wait_ms``: the ranges are already written, so there is nothing to wait
#: for, yet Java's 500 ms default showed up in reads needing several fetches per
#: partition: 300k records of 2 partitions took 1.6 s with it, 0.84 s with 10 ms (median
#: of 3, local[2]). kafka-python's reader does not wait that way (2.0 s either way).
FETCH_MAX_WAIT_MS = 10
_JVM_DEFAULTS: dict[str, Any] = {"max_poll_records": 10_000, "fetch_max_wait_ms": FETCH_MAX_WAIT_MS}
#: Java login modules for ``sasl_plain_username``/``sasl_plain_password`` per mechanism.
_LOGIN_MODULES = {
    "PLAIN": "org.apache.kafka.common.security.plain.PlainLoginModule",
    "SCRAM-SHA-256": "org.apache.kafka.common.security.scram.ScramLoginModule",
    "SCRAM-SHA-512": "org.apache.kafka.common.security.scram.ScramLoginModule",
}


def _java_value(value: Any) -> str:
    return ("true" if value else "false") if isinstance(value, bool) else str(value)


def _jaas_quoted(text: str) -> str:
    """``text`` as a double-quoted JAAS value (backslashes and quotes escaped)."""
    return '"' + str(text).replace("\\", "\\\\").replace('"', '\\"') + '"'


def consumer_options(consumer_config: Mapping[str, Any] | None = None) -> dict[str, str]:
    """``kafka.``-prefixed source options for a kafka-python ``consumer_config``.

    Defaults: the Java consumer's, but ``max_poll_records`` as the Python reader sets it
    (:data:`_JVM_DEFAULTS`). Settings that decide which records are read may not change
    (the same rule, and the same error, as
    :func:`~microbatch.kafka.reader.build_consumer_config`). Mapped beyond same-name
    settings: ``ssl_cafile`` (a PEM truststore), ``ssl_check_hostname`` (the endpoint
    identification algorithm) and ``sasl_plain_username``/``_password`` (a JAAS line for
    PLAIN or SCRAM). Anything else raises :class:`ConfigError` naming it.
    """
    given = dict(consumer_config or {})
    build_consumer_config("-", given)  # refuses changes to the fixed settings
    config = {**_JVM_DEFAULTS, **given}
    options: dict[str, str] = {}
    unmapped: list[str] = []
    for name, value in sorted(config.items()):
        if name in _SAME_MEANING:
            options["kafka." + name.replace("_", ".")] = _java_value(value)
        elif name == "ssl_cafile":
            options["kafka.ssl.truststore.type"] = "PEM"
            options["kafka.ssl.truststore.location"] = str(value)
        elif name == "ssl_check_hostname":
            options["kafka.ssl.endpoint.identification.algorithm"] = "https" if value else ""
        elif name in ("sasl_plain_username", "sasl_plain_password"):
            continue  # below, as one JAAS line
        elif name in ("enable_auto_commit", "isolation_level", "auto_offset_reset", "group_id",
                      "check_crcs"):  # fmt: skip
            continue  # unchanged fixed settings: the source sets them itself
        else:
            unmapped.append(name)
    user = config.get("sasl_plain_username")
    password = config.get("sasl_plain_password")
    if user is not None or password is not None:
        mechanism = str(config.get("sasl_mechanism") or "PLAIN")
        if user is None or password is None or mechanism not in _LOGIN_MODULES:
            raise ConfigError(
                "consumer_config: sasl_plain_username and sasl_plain_password map to the "
                f"Java consumer's sasl.jaas.config only together and for sasl_mechanism in "
                f"{sorted(_LOGIN_MODULES)} (got mechanism {mechanism!r}). Use "
                "KafkaSource(reader='python') for other set-ups."
            )
        options["kafka.sasl.jaas.config"] = (
            f"{_LOGIN_MODULES[mechanism]} required username={_jaas_quoted(user)} "
            f"password={_jaas_quoted(password)};"
        )
    if unmapped:
        raise ConfigError(
            f"consumer_config {unmapped} has no Java consumer setting of the same meaning, so "
            "Spark's Kafka source cannot take it (mapped: same-name settings such as "
            "fetch_max_bytes or security_protocol, ssl_cafile, ssl_check_hostname and "
            "sasl_plain_username/password). Remove it, or read with "
            "KafkaSource(reader='python')."
        )
    return options


def _nonempty(ranges: Iterable[OffsetRange]) -> list[OffsetRange]:
    """The ranges with records, sorted; one per partition (the source reads one range per
    partition)."""
    out = sorted(r for r in ranges if r.count > 0)
    seen: set[TopicPartition] = set()
    for r in out:
        if r.tp in seen:
            raise SourceError(
                f"{r.tp}: more than one range of one partition; Spark's Kafka source reads "
                "one range per partition (do not split ranges for it)"
            )
        seen.add(r.tp)
    return out


def range_options(ranges: Iterable[OffsetRange]) -> dict[str, str]:
    """``assign``, ``startingOffsets`` and ``endingOffsets`` (per-partition JSON) reading
    exactly ``[start, end)`` of every non-empty range.

    >>> range_options([OffsetRange("clicks", 1, 5, 9), OffsetRange("clicks", 0, 0, 3)])
    ... # doctest: +NORMALIZE_WHITESPACE
    {'assign': '{"clicks": [0, 1]}', 'startingOffsets': '{"clicks": {"0": 0, "1": 5}}',
     'endingOffsets': '{"clicks": {"0": 3, "1": 9}}'}
    """
    assign: dict[str, list[int]] = {}
    starts: dict[str, dict[str, int]] = {}
    ends: dict[str, dict[str, int]] = {}
    for r in _nonempty(ranges):
        assign.setdefault(r.topic, []).append(r.partition)
        starts.setdefault(r.topic, {})[str(r.partition)] = r.start
        ends.setdefault(r.topic, {})[str(r.partition)] = r.end
    return {
        "assign": json.dumps(assign),
        "startingOffsets": json.dumps(starts),
        "endingOffsets": json.dumps(ends),
    }


def source_options(
    bootstrap_servers: str,
    ranges: Iterable[OffsetRange],
    consumer_config: Mapping[str, Any] | None = None,
) -> dict[str, str]:
    """Every option of the Kafka batch source for reading ``ranges``."""
    return {
        **consumer_options(consumer_config),
        "kafka.bootstrap.servers": bootstrap_servers,
        "kafkaConsumer.pollTimeoutMs": str(POLL_TIMEOUT_MS),
        **range_options(ranges),
        **FIXED_OPTIONS,
    }


def check_available(
    bootstrap_servers: str,
    ranges: Sequence[OffsetRange],
    view: BrokerView | None = None,
    consumer_config: Mapping[str, Any] | None = None,
) -> None:
    """Fail with :class:`SourceError` if a range starts before the partition's earliest
    kept offset (retention deleted it after planning) or ends past its last stable offset
    (planned against another cluster). ``view``: an open one to reuse, else one is made
    (connected with ``consumer_config``)."""
    from microbatch.kafka.planner import KafkaBrokerView

    if not ranges:
        return
    tps = [r.tp for r in ranges]
    with contextlib.ExitStack() as stack:
        if view is None:
            view = stack.enter_context(
                KafkaBrokerView(bootstrap_servers, client_config=consumer_config)
            )
        earliest = view.beginning_offsets(tps)
        latest = view.end_offsets(tps)
    for r in ranges:
        where = f"reading {r.tp} [{r.start}, {r.end}) on {bootstrap_servers}"
        if earliest.get(r.tp, 0) > r.start:
            raise DataLossError(
                f"{where}: offset {r.start} is no longer available (retention deleted it after "
                f"the batch was planned; the earliest kept offset is {earliest[r.tp]}). Rerun "
                "with `microbatch run --replan` (or on_out_of_range='earliest') to plan the "
                "batch again without the deleted records, which its stats then count as "
                "skipped."
            )
        if latest.get(r.tp, r.end) < r.end:
            raise SourceError(
                f"{where}: the partition ends at offset {latest[r.tp]}, before the range does. "
                "Was the range planned against this cluster's end offsets?"
            )


def read_ranges_spark(
    spark: SparkSession,
    bootstrap_servers: str,
    ranges: Iterable[OffsetRange],
    *,
    consumer_config: Mapping[str, Any] | None = None,
    check: bool = True,
    view: BrokerView | None = None,
) -> DataFrame:
    """A DataFrame (``KAFKA_SCHEMA``) of the records of ``ranges``, read by Spark's Kafka
    source, one task per range. ``check``: verify the ranges on the driver first (see
    :func:`check_available`, which reuses ``view`` if given); without it a deleted start
    still fails, with Spark's error."""
    from pyspark.sql import functions as F

    pieces = _nonempty(ranges)
    if not pieces:
        return spark.createDataFrame([], KAFKA_SPARK_SCHEMA)
    options = source_options(bootstrap_servers, pieces, consumer_config)
    if check:
        check_available(bootstrap_servers, pieces, view, consumer_config)
    return (
        spark.read.format("kafka")
        .options(**options)
        .load()
        .select(
            "key",
            "value",
            "topic",
            "partition",
            "offset",
            F.unix_millis("timestamp").alias("timestamp"),  # the broker's epoch ms, exactly
            # No headers: null from the source, an empty list from kafka-python.
            F.coalesce("headers", F.array().cast(_HEADERS_DDL)).alias("headers"),
        )
    )


# Choosing the reader ---------------------------------------------------------------------

_PROBED: weakref.WeakKeyDictionary[Any, str | None] = weakref.WeakKeyDictionary()
_NOT_FOUND = ("DATA_SOURCE_NOT_FOUND", "Failed to find data source")


def connector_problem(spark: Any) -> str | None:
    """None if ``spark`` can load the Kafka data source, else why not.

    Resolves the source's schema once per session (no Kafka connection: only the
    connector's classes load) and remembers a definite answer; another failure is
    reported but asked again next time."""
    try:
        return _PROBED[spark]
    except (KeyError, TypeError):
        pass
    try:
        probe = spark.read.format("kafka").options(
            **{"kafka.bootstrap.servers": "127.0.0.1:9", "assign": '{"microbatch-probe": [0]}'}
        )
        _ = probe.load().schema  # Spark Connect resolves the source only when asked
        problem = None
    except Exception as e:  # pyspark's and Connect's exception types differ
        text = str(e).strip().splitlines()[0] if str(e).strip() else repr(e)
        if not any(marker in str(e) for marker in _NOT_FOUND):
            log.warning("probing Spark's Kafka data source failed: %s", text)
            return f"probing it failed: {text}"
        problem = f"Spark has no data source 'kafka' on its classpath ({text[:300]})"
    with contextlib.suppress(TypeError):  # not weakly referenceable: probe again next time
        _PROBED[spark] = problem
    return problem


def choose_reader(
    pipeline: str,
    requested: str,
    problem: str | None,
    confluent_problem: str | None = "unused",
    native_problem: str | None = "unused",
) -> Literal["python", "spark", "confluent", "native"]:
    """The reader stage 1 uses: ``requested`` (``KafkaSource.reader``) given the session's
    :func:`connector_problem` and why the native and the confluent-kafka readers cannot run
    (None: they can; ``native_reader.native_problem``, ``confluent_reader.confluent_problem``).
    "auto" prefers the native reader (the least CPU per record), then confluent-kafka, then
    the JVM source, and falls back quietly; "spark" without the connector is an error
    saying how to add it."""
    if requested not in READERS:
        raise ConfigError(f"pipeline {pipeline!r}: reader must be one of {READERS}: {requested!r}")
    if requested in ("python", "confluent", "native"):
        return cast(Literal["python", "confluent", "native"], requested)
    if requested == "auto" and native_problem is None:
        return "native"
    if requested == "auto" and confluent_problem is None:
        return "confluent"
    if problem is None:
        return "spark"
    if requested == "auto":
        return "python"
    raise ConfigError(
        f"pipeline {pipeline!r}: KafkaSource(reader='spark') reads with Spark's Kafka data "
        f"source, but this Spark session cannot load it: {problem}. Add the connector's jars: "
        "`make jars` resolves them into $MICROBATCH_HOME/spark-kafka/, and "
        "microbatch.spark.spark_session puts them on spark.jars for local and spark:// "
        "masters (a Connect server started by `make connect` gets them too); elsewhere "
        f"start Spark with `--packages {CONNECTOR}:<Spark version>`. Or use reader='auto' "
        "or 'python'."
    )
