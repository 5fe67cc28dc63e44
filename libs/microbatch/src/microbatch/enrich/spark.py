"""The Spark adapter: run the async operator inside ``mapInArrow`` tasks.

Contract of the input rows (Arrow batches of one partition):

- ``topic`` string, ``partition`` int32, ``offset`` int64 — the source coordinates;
- ``payload`` binary — ``encode_value(record)``;
- optionally ``attempts`` int32 and ``first_attempt_ms`` int64: set (non-null) on the
  pending rows of an earlier batch being re-issued; those rows must come first.

Every output row has :data:`ENRICH_SCHEMA`; ``kind`` says what it is:

- ``"output"``: one result, ``payload`` = ``encode_value(result)``;
- ``"dead_letter"``: a failed input, ``payload`` = the encoded input record, with
  ``reason``, ``error``, ``attempts`` and ``first_attempt_ms``;
- ``"pending"``: an input not finished at the deadline, ``payload`` = the encoded input
  record, with its ``attempts`` / ``first_attempt_ms``, to feed back in next batch.

Only the DataFrame API is used (no ``df.rdd``), so it also runs on Spark Connect.
pyspark itself is never imported here: the module runs in the Python workers.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator
from functools import partial
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from microbatch.enrich.elements import DeadLetter, Element, Output, PendingElement
from microbatch.enrich.loop import BatchOutcome, run_batch
from microbatch.enrich.operator import AsyncOperator
from microbatch.errors import ConfigError, EnrichmentError
from microbatch.state.codec import CodecError, decode_value, encode_value

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

INPUT_COLUMNS = ("topic", "partition", "offset", "payload")
RETRY_COLUMNS = ("attempts", "first_attempt_ms")

ENRICH_SCHEMA = pa.schema(
    [
        pa.field("kind", pa.string(), nullable=False),
        pa.field("topic", pa.string()),
        pa.field("partition", pa.int32()),
        pa.field("offset", pa.int64()),
        pa.field("payload", pa.binary()),
        pa.field("reason", pa.string()),
        pa.field("error", pa.string()),
        pa.field("attempts", pa.int32()),
        pa.field("first_attempt_ms", pa.int64()),
    ]
)

#: The same schema as a Spark DDL string, for ``mapInArrow``.
ENRICH_DDL = (
    "kind string, topic string, partition int, offset bigint, payload binary, "
    "reason string, error string, attempts int, first_attempt_ms bigint"
)

_Row = tuple[str, int, int, bytes, int | None, int | None]


def enrich_partition(
    batches: Iterable[pa.RecordBatch],
    make_operator: Callable[[], AsyncOperator],
    deadline_epoch_s: float | None = None,
    *,
    rows_per_batch: int = 4096,
) -> Iterator[pa.RecordBatch]:
    """Enrich one partition's rows; yield :data:`ENRICH_SCHEMA` batches.

    ``deadline_epoch_s`` (wall clock) is shared by every task of the batch; whatever is
    not emitted by then comes out as ``pending`` rows instead of blocking the task.
    """
    rows = _rows(batches)
    restored: list[PendingElement] = []
    first_new: _Row | None = None
    for row in rows:
        if row[4] is None:
            first_new = row
            break
        restored.append(_pending_of(row))
    fresh = _elements(itertools.chain([first_new], rows)) if first_new is not None else iter(())
    outcome = run_batch(make_operator, fresh, pending=restored, deadline_s=deadline_epoch_s)
    yield from _to_batches(outcome, rows_per_batch)


def enrich_dataframe(
    df: DataFrame,
    make_operator: Callable[[], AsyncOperator],
    deadline_epoch_s: float | None = None,
) -> DataFrame:
    """``df`` (the input contract above) enriched, as :data:`ENRICH_SCHEMA` rows.

    ``make_operator`` is shipped to the executors, so it must be picklable: a
    module-level function or a ``functools.partial`` of one.
    """
    missing = [c for c in INPUT_COLUMNS if c not in df.columns]
    if missing:
        raise ConfigError(
            f"enrich_dataframe needs columns {list(INPUT_COLUMNS)}; missing {missing} "
            f"in {df.columns}"
        )
    columns = [*INPUT_COLUMNS, *(c for c in RETRY_COLUMNS if c in df.columns)]
    fn = partial(enrich_partition, make_operator=make_operator, deadline_epoch_s=deadline_epoch_s)
    return df.select(*columns).mapInArrow(fn, ENRICH_DDL)


def _rows(batches: Iterable[pa.RecordBatch]) -> Iterator[_Row]:
    for batch in batches:
        names = batch.schema.names
        cols = [batch.column(c).to_pylist() for c in INPUT_COLUMNS]
        none = [None] * batch.num_rows
        retry = [batch.column(c).to_pylist() if c in names else none for c in RETRY_COLUMNS]
        yield from zip(*cols, *retry, strict=True)


def _decode(row: _Row) -> Any:
    try:
        return decode_value(row[3])
    except CodecError as e:
        raise EnrichmentError(
            f'cannot decode the payload of "{row[0]}"[{row[1]}]@{row[2]}: {e}. '
            "Payloads must be written with microbatch.state.codec.encode_value"
        ) from e


def _pending_of(row: _Row) -> PendingElement:
    topic, partition, offset, _, attempts, first_ms = row
    first_s = None if first_ms is None else first_ms / 1000.0
    return PendingElement(_decode(row), (topic, partition, offset), None, attempts or 0, first_s)


def _elements(rows: Iterable[_Row | None]) -> Iterator[Element]:
    for row in rows:
        assert row is not None
        if row[4] is not None:
            raise EnrichmentError(
                f're-issued pending row "{row[0]}"[{row[1]}]@{row[2]} comes after new rows: '
                "pending rows must come first in their partition"
            )
        yield Element(_decode(row), (row[0], row[1], row[2]))


def _encode(value: Any, coordinates: tuple[str, int, int] | None, what: str) -> bytes:
    try:
        return encode_value(value)
    except CodecError as e:
        where = "an input" if coordinates is None else '"{}"[{}]@{}'.format(*coordinates)
        raise EnrichmentError(f"cannot encode the {what} of {where}: {e}") from e


def _to_batches(outcome: BatchOutcome, rows_per_batch: int) -> Iterator[pa.RecordBatch]:
    columns: dict[str, list[Any]] = {name: [] for name in ENRICH_SCHEMA.names}

    def add(kind, coordinates, payload, reason=None, error=None, attempts=None, first_s=None):
        topic, partition, offset = coordinates or (None, None, None)
        for name, value in (
            ("kind", kind),
            ("topic", topic),
            ("partition", partition),
            ("offset", offset),
            ("payload", payload),
            ("reason", reason),
            ("error", error),
            ("attempts", attempts),
            ("first_attempt_ms", None if first_s is None else round(first_s * 1000)),
        ):
            columns[name].append(value)

    items: Iterator[Any] = itertools.chain(outcome.outputs, outcome.dead_letters, outcome.pending)
    for item in items:
        if isinstance(item, Output):
            add("output", item.coordinates, _encode(item.value, item.coordinates, "result"))
        elif isinstance(item, DeadLetter):
            payload = _encode(item.record, item.coordinates, "record")
            add(
                "dead_letter",
                item.coordinates,
                payload,
                item.reason,
                item.error,
                item.attempts,
                item.first_attempt_s,
            )
        elif isinstance(item, PendingElement) and item.watermark is None:
            payload = _encode(item.record, item.coordinates, "record")
            add(
                "pending",
                item.coordinates,
                payload,
                None,
                None,
                item.attempts,
                item.first_attempt_s,
            )
        else:
            continue  # watermarks have no row form here
        if len(columns["kind"]) >= rows_per_batch:
            yield pa.RecordBatch.from_pydict(columns, schema=ENRICH_SCHEMA)
            columns = {name: [] for name in ENRICH_SCHEMA.names}
    if columns["kind"]:
        yield pa.RecordBatch.from_pydict(columns, schema=ENRICH_SCHEMA)
