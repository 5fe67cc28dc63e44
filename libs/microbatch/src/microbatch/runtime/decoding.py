"""How a record's value and event time are read: by stage 1 from Kafka, by stage 2 from
an envelope's payload, and by every later step and join — one reading each, so a value
decodes and a time converts the same wherever it is read.
"""

from __future__ import annotations

import datetime as dt
import json
import json.scanner
import math
from typing import Any, cast

from microbatch.runtime.envelope import decode_payload
from microbatch.runtime.pipeline import KafkaSource, Pipeline, json_decoder
from microbatch.runtime.steps import filters_only


def event_time_ms(value: object) -> int:
    """An event time as epoch ms: an int/float of ms, an ISO-8601 string or a datetime
    (naive: UTC), exactly (no float rounding of the datetime); anything else raises
    ValueError. The one reading of an event time: stage 1, later steps and the joins."""
    if isinstance(value, bool):
        raise ValueError(f"event time must be epoch ms, ISO-8601 or a datetime, got {value!r}")
    if isinstance(value, int | float):
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"event time must be a finite number of ms, got {value!r}")
        if not MIN_EPOCH_MS <= value <= MAX_EPOCH_MS:
            raise ValueError(f"event time {value!r} ms is out of range (64-bit epoch ms)")
        return int(value)
    if isinstance(value, str):
        value = dt.datetime.fromisoformat(value.replace("Z", "+00:00"))
    if isinstance(value, dt.datetime):
        if value.tzinfo is None:
            value = value.replace(tzinfo=dt.UTC)
        return (value - _EPOCH) // _MS
    raise ValueError(
        f"event time must be epoch ms, ISO-8601 or a datetime, got {type(value).__name__}"
    )


MIN_EPOCH_MS, MAX_EPOCH_MS = -(2**63), 2**63 - 1  # an Arrow int64: an inline int check's bounds
_EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)
_MS = dt.timedelta(milliseconds=1)


# typeshed types the scanner's context as a make_scanner; it reads a JSONDecoder's attributes.
_JSON_SCAN = json.scanner.make_scanner(cast("json.scanner.make_scanner", json.JSONDecoder()))


def fast_json_decoder(value: bytes) -> Any:
    """``json.loads(value)``, same results and same errors, minus its per-call overhead
    (encoding detection, two whitespace regex matches: half its time on a small record)
    for the common case, a UTF-8 document without surrounding whitespace. Everything
    else (other encodings, a BOM, whitespace, errors) goes to ``json.loads`` itself."""
    if type(value) is bytes:
        try:
            text = value.decode("utf-8")
            record, end = _JSON_SCAN(text, 0)
            if end == len(text):
                return record
        except (ValueError, StopIteration):
            pass
    return json.loads(value)


def source_decoder(source: Pipeline | KafkaSource) -> Any:
    """The value decoder of a pipeline's source (or of a source); the default
    (``json_decoder``) as its fast twin."""
    decoder = (source.source if isinstance(source, Pipeline) else source).decoder
    return fast_json_decoder if decoder is json_decoder else decoder


def payload_decoder(pipeline: Pipeline) -> Any:
    """How stage 2 turns a record's payload back into the record (see ``add_record``)."""
    changed = pipeline.prefix and not filters_only(pipeline.prefix)
    if changed or (pipeline.prefix and pipeline.column_steps):  # records built from columns
        return decode_payload
    if pipeline.enrich is not None or pipeline.inputs or pipeline.edges:  # not raw
        return decode_payload
    return source_decoder(pipeline)
