"""Table join: a stream joined with a changelog topic's latest value per key (Kafka
Streams' KStream-KTable join, Quix's ``join_lookup`` on a topic).

The right side (side 1) is the table: a compacted or changelog topic keyed like the
stream. Each right record replaces the key's value; a tombstone — a ``None`` record (a
Kafka delete), or a record for which ``tombstone(record)`` is true — deletes it. A
topic's real tombstones (a key with a null value) arrive as ``None`` records when its
source says ``KafkaSource(tombstones=True)``, keyed by their Kafka key
(:mod:`microbatch.runtime.tombstones`). The value
lives in the step's keyed state (value state ``table``), so it survives batches, crashes
and rescaling like any state. Left records (the stream) are not kept.

**Which value a stream record sees.** Two topics have no common order, so within a batch
the rule is fixed: **the batch's table records first** — in source order, the last one
wins — **then the stream records**, in source order. A stream record thus joins the
table's value as of the end of its batch's changelog records: a row created in the same
batch as the first order for it is found, a row deleted in the same batch is not. Across
batches it is the KTable rule: the value left by every earlier batch. Table records are
never late (a changelog's latest value is the latest whatever its timestamp), and no
event time is read.

**A batch at once.** :meth:`TableJoin.process_batch` does this for every key of a
batch before any ``process`` call (values encoded and written in one go); a key whose
``select`` or ``tombstone`` raises is left to ``process``.

**Column by column.** With ``select=fields(...)`` and no ``tombstone`` function, where
each input's records are alike (rows of a declared schema: sources with a
``value_schema``, after their ``where``/``select``; or flat records of the same fields
and types; the table's ``None`` records, its deletes, aside), a batch is joined on Arrow
columns: the table's new values are stored as the payloads they came as, a stored value
is read back into columns, and the output is a table taken from both sides' columns —
no dict per record. Same rule, same state, same
output; a batch it cannot take so (a record that is not a row of its side's schema, a
stored value of another shape) goes record by record.

``how="inner"``: a stream record with no value for its key emits nothing. ``"left"``: it
is emitted with the right side ``None``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, cast

import numpy as np
import pyarrow as pa

from microbatch.errors import ConfigError
from microbatch.joins.base import LEFT, RIGHT, JoinFunction, check_how, side_tables
from microbatch.joins.select import Fields, Select, check_select
from microbatch.runtime.process import Handled, KeyedBatch, ProcessContext
from microbatch.state.codec_rows import decode_rows, schema_of_records

HOWS = ("inner", "left")
STATE = "table"


class TableJoin(JoinFunction):
    """Left (stream) records joined with the right (changelog) side's latest value.

    ``how``: ``"inner"`` or ``"left"``. ``select(left, right)`` makes the output record
    (default :func:`~microbatch.joins.select.merge`). ``tombstone(record) -> bool``: which
    right records delete the key's value besides ``None``.
    """

    #: No timers: a table join runs with or without the pipeline's event time.
    needs_event_time = False
    #: The table side takes ``None`` records (a source's Kafka tombstones) as deletes.
    tombstone_sides = (RIGHT,)

    def __init__(
        self,
        how: str = "inner",
        select: Select | None = None,
        tombstone: Callable[[Any], bool] | None = None,
    ) -> None:
        op = self.name
        self.how = check_how(op, how, HOWS)
        self.select = check_select(op, select)
        if tombstone is not None and not callable(tombstone):
            raise ConfigError(f"{op} tombstone must be a function record -> bool: {tombstone!r}")
        self.tombstone = tombstone

    def __repr__(self) -> str:
        return f"TableJoin(how={self.how!r})"

    @property
    def reads_columns(self) -> bool:
        """Can a batch be joined on columns (``batch.columns``)? With ``fields(...)``
        for ``select`` and no ``tombstone`` function, which read records."""
        return isinstance(self.select, Fields) and self.tombstone is None

    def is_tombstone(self, record: Any) -> bool:
        return record is None or (self.tombstone is not None and bool(self.tombstone(record)))

    def process_batch(self, batch: KeyedBatch) -> Handled | None:
        """Every key at once: its last table record of the batch becomes its value (or
        deletes it), written for all keys in one go; its stream records are joined with
        the value. A key whose ``select`` or ``tombstone`` raises is left to ``process``
        (its state untouched here), which fails or dead-letters it as it does."""
        sides = batch.sides
        if sides is None or not len(batch.records) or sides.max() > 1:
            return None  # (a record of a third input: process() refuses it)
        if batch.columns is not None and self.reads_columns:
            joined = self._join_columns(batch)
            if joined is not None:
                return joined
        records, count = batch.records, batch.key_count
        key_of = batch.key_of()
        changes = np.nonzero(sides == RIGHT)[0]  # the table's records, in order
        changed = key_of[changes]
        last = np.ones(len(changes), dtype=bool)
        last[:-1] = changed[1:] != changed[:-1]  # each key's last change decides
        updates = dict(zip(changed[last].tolist(), changes[last].tolist(), strict=True))
        streams = np.nonzero(sides != RIGHT)[0]
        state, select, left = batch.value(STATE), self.select, self.how == "left"
        values: dict[int, Any] = {}
        failed: set[int] = set()
        for k, at in updates.items():
            try:
                values[k] = None if self.is_tombstone(records[at]) else records[at]
            except Exception:  # process() calls it again and fails or dead-letters
                failed.add(k)
        emitted: dict[int, list[Any]] = {}
        stream_keys = key_of[streams].tolist()
        stored = sorted(set(stream_keys) - values.keys() - failed)
        current = dict(values)  # and the stored value of each other key, read at once
        current.update(zip(stored, state.get_many(stored), strict=True))
        for k, at in zip(stream_keys, streams.tolist(), strict=True):
            if k in failed:
                continue
            value = current[k]
            if value is None and not left:
                continue
            try:
                out = select(records[at], value)
            except Exception:
                failed.add(k)
                emitted.pop(k, None)
                continue
            emitted.setdefault(k, []).append(out)
        kept = [(k, v) for k, v in values.items() if k not in failed]
        state.set_many([k for k, v in kept if v is not None], [v for _, v in kept if v is not None])
        for k, v in kept:
            if v is None:
                state.clear(k)
        handled = np.ones(count, dtype=bool)
        handled[list(failed)] = False
        return Handled(handled, emitted)

    def _join_columns(self, batch: KeyedBatch) -> Handled | None:
        """:meth:`process_batch` on the sides' columns, every key at once; None when a
        side has no columns or a stored value is not a row of the table's schema."""
        assert batch.columns is not None and batch.sides is not None
        select = cast("Fields", self.select)
        tables = side_tables(batch, select)
        if tables is None:
            return None
        stream, table = tables
        count, sides, key_of = batch.key_count, batch.sides, batch.key_of()
        changed = key_of[sides == RIGHT]  # each table record's key, in order
        last = np.ones(len(changed), dtype=bool)
        last[:-1] = changed[1:] != changed[:-1]  # each key's last change decides
        updated, updates = changed[last], np.flatnonzero(last)
        deletes = batch.columns.deleted(RIGHT)[updates]  # the last change is a tombstone
        stream_keys = key_of[sides == LEFT]
        # Each key's value: a row of `values` — this batch's last change, else stored;
        # -2: deleted in the batch.
        value_row = np.full(count, -1, dtype=np.int64)
        value_row[updated] = np.where(deletes, -2, np.arange(len(updated)))
        wanted = np.unique(stream_keys[value_row[stream_keys] == -1])
        state = batch.value(STATE)
        found = [(k, data) for k, data in zip(wanted.tolist(), state.get_many_encoded(
            wanted.tolist()), strict=True) if data is not None]  # fmt: skip
        datas, schema = pa.array([d for _, d in found], pa.binary()), table.schema
        if any(pa.types.is_null(t) for t in schema.types):  # no table row this batch
            schema = schema_of_records(datas) or schema  # and none declared: as stored
        stored = decode_rows(datas, schema)
        if stored is None:
            return None
        value_row[[k for k, _ in found]] = len(updated) + np.arange(len(found))
        values = pa.concat_tables([table.take(updates), stored], promote_options="default")
        rows = value_row[stream_keys]
        matched = rows >= 0
        if self.how == "inner":
            kept = np.flatnonzero(matched)
            at = pa.array(rows[kept])
        else:
            kept = np.arange(len(rows))
            at = pa.array(rows, mask=~matched)
        taken = stream.take(kept)
        columns = [taken.column(f) for _, f in select.left]
        columns += [values.column(f).take(at) for _, f in select.right]
        values_at = updates[~deletes]
        state.set_many_encoded(
            updated[~deletes].tolist(), batch.columns.payloads(RIGHT).take(values_at).to_pylist()
        )
        for k in updated[deletes].tolist():
            state.clear(k)
        return Handled(
            np.ones(count, dtype=bool), {}, pa.table(columns, names=select.names),
            stream_keys[kept],
        )  # fmt: skip

    def process(self, key: Any, records: Sequence[Any], ctx: ProcessContext) -> None:
        stream, table = self.split(records)
        state = ctx.value(STATE)
        if table:
            last = table[-1]  # the batch's last change decides; earlier ones are overwritten
            value = None if self.is_tombstone(last) else last
            if value is None:
                state.clear()
            else:
                state.set(value)
        else:
            value = state.get()
        for record in stream:
            if value is not None:
                ctx.emit(self.select(record, value))
            elif self.how == "left":
                ctx.emit(self.select(record, None))
