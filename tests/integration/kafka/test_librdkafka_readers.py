"""Both librdkafka readers (confluent-kafka's and microbatch's native one) return exactly
what the kafka-python reader returns.

On a real broker: committed and aborted transactions (offset gaps: markers and aborted
records), ranges starting and ending on markers and inside aborted records, ranges in the
middle of the log, null keys and values, empty values, headers; a deleted start and a range
past the log's end fail as ``read_range`` fails. The reference is ``read_range``, itself
checked against a plain ``read_committed`` consumer in ``test_kafka_source.py``.
"""

from __future__ import annotations

from typing import Any

import pyarrow as pa
import pytest

from microbatch.errors import DataLossError, SourceError
from microbatch.kafka import (
    KAFKA_SCHEMA,
    KafkaBrokerView,
    OffsetRange,
    TopicPartition,
    read_range,
    read_range_confluent,
)
from microbatch.kafka.native_reader import read_range_native
from tests.integration.kafka.test_kafka_source import new_topic, produce

pytestmark = pytest.mark.integration

#: The readers' no-progress timeout: a reader waiting for an offset that holds no record
#: fails with a SourceError after it (test_kafka_source.py's
#: test_read_range_past_the_end_times_out_with_a_named_error), never returns late.
POLL_S = 5


#: The readers under test, each against kafka-python's ``read_range``.
LIBRDKAFKA_READERS = pytest.mark.parametrize(
    "read", [read_range_confluent, read_range_native], ids=["confluent", "native"]
)


def table(batches: list[pa.RecordBatch]) -> list[dict[str, Any]]:
    return pa.Table.from_batches(batches, KAFKA_SCHEMA).to_pylist()


@LIBRDKAFKA_READERS
def test_every_subrange_of_a_transactional_log_reads_what_read_range_reads(
    read, bootstrap, admin
) -> None:
    topic = new_topic(admin, 1)
    headers = [("trace", b"t-1"), ("empty", b"")]
    produce(
        bootstrap, topic, [(0, b"k0", b"p0"), (0, None, b""), (0, b"k1", None)], headers=headers
    )
    produce(bootstrap, topic, [(0, b"c", f"c{i}".encode()) for i in range(3)], transaction="commit")
    produce(bootstrap, topic, [(0, None, f"x{i}".encode()) for i in range(3)], transaction="abort")
    produce(bootstrap, topic, [(0, None, b"after")])
    produce(bootstrap, topic, [(0, None, f"y{i}".encode()) for i in range(2)], transaction="abort")
    tp = TopicPartition(topic, 0)
    with KafkaBrokerView(bootstrap) as view:
        end = view.end_offsets([tp])[tp]
    # 0-2 plain, 3-5 committed, 6 marker, 7-9 aborted, 10 marker, 11 plain, 12-13 aborted, 14
    assert end == 15

    # Several ranges end on offsets without records (markers, aborted records). A reader
    # that waited for them would make no progress and raise SourceError after POLL_S:
    # every read below returning its records shows that none waited.
    for start, stop in [(0, end), (0, 7), (0, 6), (3, 11), (6, 7), (7, 10), (7, 12), (4, 5),
                        (2, 4), (11, end), (12, end), (14, end)]:  # fmt: skip
        r = OffsetRange(topic, 0, start, stop)
        ours = list(read(bootstrap, r, batch_rows=2, poll_timeout_s=POLL_S))
        theirs = list(read_range(bootstrap, r, batch_rows=2, poll_timeout_s=POLL_S))
        assert all(b.schema == KAFKA_SCHEMA and b.num_rows <= 2 for b in ours)
        assert table(ours) == table(theirs), (start, stop)
    whole = table(list(read(bootstrap, OffsetRange(topic, 0, 0, end), poll_timeout_s=POLL_S)))
    assert [(r["key"], r["value"]) for r in whole] == [
        (b"k0", b"p0"), (None, b""), (b"k1", None), (b"c", b"c0"), (b"c", b"c1"), (b"c", b"c2"),
        (None, b"after"),
    ]  # fmt: skip
    assert [h for r in whole[:3] for h in r["headers"]] == [
        {"key": k, "value": v} for k, v in headers * 3
    ]
    assert whole[3]["headers"] == [] and whole[0]["timestamp"] > 1_600_000_000_000


def test_source_only_reads_give_the_same_records_without_timestamps_or_headers(
    bootstrap, admin
) -> None:
    """Stage 1 asks both readers for the source columns only: the same keys, values and
    coordinates as a full read, with ``timestamp`` and ``headers`` null, never guessed."""
    topic = new_topic(admin, 1)
    produce(bootstrap, topic, [(0, b"k0", b"p0"), (0, None, b"")], headers=[("h", b"x")])
    produce(bootstrap, topic, [(0, b"c", f"c{i}".encode()) for i in range(3)], transaction="commit")
    produce(bootstrap, topic, [(0, None, b"x")], transaction="abort")
    produce(bootstrap, topic, [(0, None, b"after")])
    r = OffsetRange(topic, 0, 0, 9)
    full = table(list(read_range(bootstrap, r, batch_rows=2, poll_timeout_s=5)))
    assert len(full) == 6 and full[0]["headers"] and full[0]["timestamp"] is not None
    expected = [{**row, "timestamp": None, "headers": None} for row in full]
    for read in (read_range, read_range_confluent, read_range_native):
        batches = list(read(bootstrap, r, batch_rows=2, poll_timeout_s=5, source_only=True))
        assert all(b.schema == KAFKA_SCHEMA for b in batches)
        assert table(batches) == expected, read.__name__


@LIBRDKAFKA_READERS
def test_a_deleted_start_fails_as_data_loss_never_skips(read, bootstrap, admin) -> None:
    from kafka import TopicPartition as KTP

    topic = new_topic(admin, 1)
    produce(bootstrap, topic, [(0, None, f"{i}".encode()) for i in range(100)])
    admin.delete_records({KTP(topic, 0): 50})

    with pytest.raises(DataLossError, match="offset 10 is no longer available") as err:
        list(read(bootstrap, OffsetRange(topic, 0, 10, 100), poll_timeout_s=10))
    assert f"{topic}[0] [10, 100) on {bootstrap}" in str(err.value)
    assert "--replan" in str(err.value)


def test_the_native_reader_ends_a_batch_before_its_bytes_would_pass_the_limit(
    bootstrap, admin
) -> None:
    """A batch holds at most ``batch_bytes`` of keys (or values): the record that would
    pass it starts the next batch (carried over, never dropped or read twice); a record
    larger than the limit is a batch of its own."""
    topic = new_topic(admin, 1)
    values = [b"abc", b"de", b"f", b"0123456789", b"gh", None, b"ij"]
    produce(bootstrap, topic, [(0, b"k", v) for v in values])
    r = OffsetRange(topic, 0, 0, len(values))
    batches = list(read_range_native(bootstrap, r, batch_bytes=6, poll_timeout_s=POLL_S))
    # keys take 1 byte a record: each batch stops before 6 bytes of keys or of values
    assert [b.column("value").to_pylist() for b in batches] == [
        [b"abc", b"de", b"f"], [b"0123456789"], [b"gh", None, b"ij"],
    ]  # fmt: skip
    assert table(batches) == table(list(read_range(bootstrap, r, poll_timeout_s=POLL_S)))


@LIBRDKAFKA_READERS
def test_a_refused_login_fails_the_read_saying_what_to_check(
    read, sasl_settings, bootstrap, admin
) -> None:
    topic = new_topic(admin, 1)
    produce(bootstrap, topic, [(0, None, b"x")] * 3)
    r = OffsetRange(topic, 0, 0, 3)
    secured = sasl_settings.kafka_bootstrap_servers
    config = sasl_settings.kafka_client_config(None)
    assert table(list(read(secured, r, consumer_config=config, poll_timeout_s=POLL_S))) == table(
        list(read_range(bootstrap, r, poll_timeout_s=POLL_S))
    )
    wrong = {**config, "sasl_plain_password": "not-the-password"}
    with pytest.raises(SourceError, match="the broker refused the connection") as err:
        list(read(secured, r, consumer_config=wrong, poll_timeout_s=POLL_S))
    assert f"{topic}[0] [0, 3) on {secured}" in str(err.value)
    assert "MICROBATCH_KAFKA_SASL_" in str(err.value)
