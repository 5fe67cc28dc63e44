"""Stage 1 of a batch, inside Spark tasks: Kafka rows → decoded, keyed records.

Each Kafka record becomes one *envelope* row: either a ``record`` (decoded value, its key,
key-group, operator instance and event time) or a ``dead_letter`` (reason, error and the
raw bytes), never both, never neither — so nothing is lost and nothing doubled here.

Dead-letter reasons: ``undecodable`` (the decoder raised), ``missing_key`` /
``bad_key`` (key_by gave None or a type keys cannot have), ``missing_event_time`` /
``bad_event_time``, ``late`` (event time behind the watermark the batch started with),
``enrichment_timeout`` / ``enrichment_error`` / ``enrichment_invalid_result`` (the
async operator dead-lettered it, with its attempt count).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import time
import traceback
from collections import Counter
from collections.abc import Iterable, Iterator
from typing import Any

import pyarrow as pa

from microbatch.errors import MicrobatchError
from microbatch.kafka.reader import read_descriptors
from microbatch.keygroups import encode_key, key_group_of_bytes, operator_index
from microbatch.runtime.faults import crash_if
from microbatch.runtime.pipeline import Pipeline
from microbatch.state.codec import encode_value

ENVELOPE_SCHEMA = pa.schema(
    [
        ("kind", pa.string()),
        ("topic", pa.string()),
        ("partition", pa.int32()),
        ("offset", pa.int64()),
        ("seq", pa.int32()),
        ("instance", pa.int32()),
        ("key_group", pa.int32()),
        ("key", pa.binary()),
        ("event_ts", pa.int64()),
        ("payload", pa.binary()),
        ("raw_key", pa.binary()),
        ("raw_value", pa.binary()),
        ("reason", pa.string()),
        ("error", pa.string()),
        ("attempts", pa.int32()),
    ]
)
RECORD = "record"
DEAD_LETTER = "dead_letter"
#: An enrichment input not finished by the batch deadline; ``payload`` is the pending
#: element, carried to the next batch through the checkpoint.
PENDING = "pending"
#: One per task and source partition: ``offset`` holds how many inputs it consumed.
STAT = "stat"
#: Header marking a re-issued pending element among the Kafka rows of stage 1.
PENDING_HEADER = "microbatch.pending"


class _Bad(Exception):
    def __init__(self, reason: str, error: str) -> None:
        super().__init__(error)
        self.reason = reason
        self.error = error


def event_time_ms(value: Any) -> int:
    """An event time as epoch ms: an int/float of ms, or an ISO-8601 string (naive = UTC)."""
    if isinstance(value, bool):
        raise ValueError(f"event time must be epoch ms or ISO-8601, got {value!r}")
    if isinstance(value, int | float):
        return int(value)
    if isinstance(value, str):
        parsed = dt.datetime.fromisoformat(value.replace("Z", "+00:00"))
        if parsed.tzinfo is None:
            parsed = parsed.replace(tzinfo=dt.UTC)
        return int(parsed.timestamp() * 1000)
    raise ValueError(f"event time must be epoch ms or ISO-8601, got {type(value).__name__}")


def _json_bytes(value: Any) -> bytes:
    import json

    return json.dumps(value, sort_keys=True, default=str).encode()


def _error_text(e: BaseException) -> str:
    return "".join(traceback.format_exception_only(type(e), e)).strip()[:2000]


@dataclasses.dataclass(frozen=True)
class StageOne:
    """The picklable stage-1 function: what it needs from the driver, nothing else."""

    pipeline: Pipeline
    parallelism: int
    watermark: int | None
    crash_at: str | None = None
    #: Set: the input rows are range descriptors and this task reads them from Kafka
    #: itself (one Python worker per task instead of two chained ones).
    bootstrap_servers: str | None = None

    def keyed(self, record: Any) -> tuple[bytes, int, int | None]:
        """(key bytes, key-group, event time) of a decoded record, or raise ``_Bad``."""
        try:
            key = self.pipeline.key_of(record)
        except Exception as e:  # user code: a dead letter, with the cause
            raise _Bad("bad_key", f"key_by raised {_error_text(e)}") from e
        if key is None:
            raise _Bad("missing_key", f"key_by {self.pipeline.key_by!r} gave no key")
        try:
            key_bytes = encode_key(key)
        except MicrobatchError as e:
            raise _Bad("bad_key", str(e)) from e
        kg = key_group_of_bytes(key_bytes, self.pipeline.max_parallelism)
        ts = None
        et = self.pipeline.event_time
        if et is not None:
            raw = record.get(et.field) if isinstance(record, dict) else None
            if raw is None:
                raise _Bad("missing_event_time", f"record has no event-time field {et.field!r}")
            try:
                ts = event_time_ms(raw)
            except (ValueError, TypeError, OverflowError) as e:
                raise _Bad("bad_event_time", f"field {et.field!r}: {e}") from e
            if self.watermark is not None and ts < self.watermark:
                raise _Bad(
                    "late",
                    f"event time {ts} is behind the watermark {self.watermark} "
                    f"(allowed lateness {et.allowed_lateness_s}s)",
                )
        return key_bytes, kg, ts

    def decode(self, value: bytes | None) -> Any:
        if value is None:
            raise _Bad("undecodable", "record has no value (tombstone)")
        try:
            return self.pipeline.source.decoder(value)
        except Exception as e:
            raise _Bad("undecodable", _error_text(e)) from e

    def __call__(self, batches: Iterable[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        """mapInArrow body: Kafka rows in, envelope rows out (same count, minus none)."""
        where = f"pipeline {self.pipeline.name!r} stage 1"
        if self.bootstrap_servers is not None:
            batches = read_descriptors(batches, self.bootstrap_servers)
        if self.pipeline.enrich is None:
            for batch in batches:
                yield self.envelopes(batch)
                crash_if(self.crash_at, "during_read", where)
            return
        yield self.enriched(list(batches))
        crash_if(self.crash_at, "during_read", where)

    def envelopes(self, batch: pa.RecordBatch) -> pa.RecordBatch:
        out = EnvelopeBuilder()
        cols = batch.to_pydict()
        inputs: Counter[tuple[str, int]] = Counter()
        for topic, part, off, rkey, rvalue in zip(
            cols["topic"],
            cols["partition"],
            cols["offset"],
            cols["key"],
            cols["value"],
            strict=True,
        ):
            inputs[(topic, part)] += 1
            try:
                record = self.decode(rvalue)
                self.add_record(out, topic, part, off, 0, record, raw=rvalue)
            except _Bad as bad:
                out.dead(topic, part, off, self.parallelism, bad.reason, bad.error, rkey, rvalue)
        out.stats(inputs)
        return out.build()

    def enriched(self, batches: list[pa.RecordBatch]) -> pa.RecordBatch:
        """Decode a whole task's rows, enrich them until the deadline, key the results.

        Inputs not enriched by the deadline become ``pending`` rows (re-issued next
        batch); a pending element re-issued from the last checkpoint arrives as a Kafka
        row with the :data:`PENDING_HEADER` header."""
        from microbatch.enrich import Element, PendingElement, run_batch

        enrich = self.pipeline.enrich
        if enrich is None:
            raise ValueError("enriched() needs a pipeline with enrich=")
        out = EnvelopeBuilder()
        elements, pending, raw = [], [], {}
        inputs: Counter[tuple[str, int]] = Counter()
        for batch in batches:
            cols = batch.to_pydict()
            for topic, part, off, rkey, rvalue, headers in zip(
                cols["topic"], cols["partition"], cols["offset"], cols["key"], cols["value"],
                cols["headers"], strict=True,
            ):  # fmt: skip
                if any(h["key"] == PENDING_HEADER for h in headers or ()):
                    pending.append(PendingElement.from_bytes(rvalue))
                    continue
                inputs[(topic, part)] += 1
                try:
                    record = self.decode(rvalue)
                except _Bad as bad:
                    out.dead(
                        topic, part, off, self.parallelism, bad.reason, bad.error, rkey, rvalue
                    )
                    continue
                raw[(topic, part, off)] = (rkey, rvalue)
                elements.append(Element(record, (topic, part, off)))
        # The deadline counts from the task's start of enrichment, not the driver's clock:
        # scheduling delays must not eat a task's budget.
        deadline = None if enrich.deadline_s is None else time.time() + enrich.deadline_s
        outcome = run_batch(enrich.make_operator, elements, pending=pending, deadline_s=deadline)
        seqs: Counter[tuple[str, int, int]] = Counter()
        for o in outcome.outputs:
            if getattr(o, "coordinates", None) is None:  # a watermark: the runtime sends none
                continue
            coords = tuple(o.coordinates)
            topic, part, off = coords
            seq = seqs[coords]
            seqs[coords] += 1
            try:
                self.add_record(out, topic, part, off, seq, o.value)
            except _Bad as bad:
                rkey, rvalue = raw.get(coords) or (None, _json_bytes(o.value))
                out.dead(topic, part, off, self.parallelism, bad.reason, bad.error, rkey, rvalue,
                         seq=seq)  # fmt: skip
        for d in outcome.dead_letters:
            topic, part, off = d.coordinates or ("", 0, 0)
            rkey, rvalue = raw.get((topic, part, off)) or (None, _json_bytes(d.record))
            out.dead(topic, part, off, self.parallelism, f"enrichment_{d.reason}", d.error,
                     rkey, rvalue, attempts=d.attempts)  # fmt: skip
        for p in outcome.pending:
            if p.coordinates is None:
                continue
            topic, part, off = p.coordinates
            out.add(PENDING, topic, part, off, 0, 0, None, None, None, p.to_bytes(),
                    attempts=p.attempts)  # fmt: skip
        out.stats(inputs)
        return out.build()

    def add_record(
        self,
        out: EnvelopeBuilder,
        topic: str,
        part: int,
        off: int,
        seq: int,
        record: Any,
        raw: bytes | None = None,
    ) -> None:
        """Append ``record`` as a keyed row; raises ``_Bad`` (nothing appended) if unfit.

        ``raw``: the record's source bytes, carried instead of re-encoding the record when
        stage 2 can decode them again (no enrichment changed it): the decoder (C-speed
        JSON) is much cheaper than the pure-Python state codec."""
        key_bytes, kg, ts = self.keyed(record)
        if raw is not None:
            payload = raw
        else:
            try:
                payload = encode_value(record)
            except MicrobatchError as e:
                raise _Bad("undecodable", f"decoded value is not plain data: {e}") from e
        inst = operator_index(kg, self.pipeline.max_parallelism, self.parallelism)
        out.add(RECORD, topic, part, off, seq, inst, kg, key_bytes, ts, payload)


class EnvelopeBuilder:
    """Column lists for one envelope batch."""

    def __init__(self) -> None:
        self.cols: dict[str, list[Any]] = {f.name: [] for f in ENVELOPE_SCHEMA}

    def add(
        self,
        kind: str,
        topic: str,
        part: int,
        off: int,
        seq: int,
        instance: int,
        kg: int | None,
        key: bytes | None,
        ts: int | None,
        payload: bytes | None,
        raw_key: bytes | None = None,
        raw_value: bytes | None = None,
        reason: str | None = None,
        error: str | None = None,
        attempts: int | None = None,
    ) -> None:
        row = (kind, topic, part, off, seq, instance, kg, key, ts, payload, raw_key,
               raw_value, reason, error, attempts)  # fmt: skip
        for name, v in zip(self.cols, row, strict=True):
            self.cols[name].append(v)

    def dead(
        self,
        topic: str,
        part: int,
        off: int,
        parallelism: int,
        reason: str,
        error: str,
        raw_key: bytes | None,
        raw_value: bytes | None,
        attempts: int | None = None,
        seq: int = 0,
    ) -> None:
        """A dead letter, routed to a deterministic instance that stages it."""
        inst = (part + off) % parallelism
        self.add(DEAD_LETTER, topic, part, off, seq, inst, None, None, None, None, raw_key,
                 raw_value, reason, error, attempts)  # fmt: skip

    def stats(self, inputs: Counter[tuple[str, int]]) -> None:
        for (topic, part), n in sorted(inputs.items()):
            self.add(STAT, topic, part, n, 0, 0, None, None, None, None)

    def build(self) -> pa.RecordBatch:
        return pa.RecordBatch.from_pydict(self.cols, schema=ENVELOPE_SCHEMA)


def payload_decoder(pipeline: Pipeline) -> Any:
    """How stage 2 turns a record's payload back into the record (see ``add_record``)."""
    from microbatch.state.codec import decode_value

    return decode_value if pipeline.enrich is not None else pipeline.source.decoder
