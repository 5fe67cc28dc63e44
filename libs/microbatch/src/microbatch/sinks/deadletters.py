"""The shape of a dead letter, for Parquet and for Kafka.

A dead letter keeps the record's original bytes and says why it was set aside and where
it came from, so it can be inspected and replayed. In Parquet: one row with the columns of
:data:`DEAD_LETTER_SCHEMA`. In Kafka: the original key and value, and the rest as
``microbatch.*`` headers (the convention Kafka Connect uses for its dead-letter queues).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pyarrow as pa

from microbatch.sinks.kafka import MESSAGE_SCHEMA

DEAD_LETTER_SCHEMA = pa.schema(
    [
        ("pipeline", pa.string()),
        ("batch_id", pa.int64()),
        ("reason", pa.string()),
        ("error", pa.string()),
        ("topic", pa.string()),
        ("partition", pa.int32()),
        ("offset", pa.int64()),
        ("attempts", pa.int32()),
        ("raw_key", pa.binary()),
        ("raw_value", pa.binary()),
    ]
)


def dead_letter_table(rows: Sequence[dict[str, Any]]) -> pa.Table:
    return pa.Table.from_pylist(list(rows), schema=DEAD_LETTER_SCHEMA)


def dead_letter_messages(rows: Sequence[dict[str, Any]]) -> pa.Table:
    keys, values, headers = [], [], []
    for r in rows:
        keys.append(r["raw_key"])
        values.append(r["raw_value"])
        h = [
            ("microbatch.pipeline", r["pipeline"]),
            ("microbatch.batch_id", str(r["batch_id"])),
            ("microbatch.reason", r["reason"]),
            ("microbatch.error", r["error"] or ""),
            ("microbatch.topic", r["topic"] or ""),
            ("microbatch.partition", "" if r["partition"] is None else str(r["partition"])),
            ("microbatch.offset", "" if r["offset"] is None else str(r["offset"])),
            ("microbatch.attempts", "" if r["attempts"] is None else str(r["attempts"])),
        ]
        headers.append([{"key": k, "value": v.encode()} for k, v in h])
    return pa.table({"key": keys, "value": values, "headers": headers}, schema=MESSAGE_SCHEMA)
