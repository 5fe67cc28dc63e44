"""A table join with ``select=fields(...)`` over sources with declared schemas joins on
Arrow columns: the same output, state and dead letters as the same join record by
record — across batches that read values stored by earlier ones, updates in the batch
of the stream records that see them, inner and left — without decoding a record."""

from __future__ import annotations

import collections
import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest

from microbatch.checkpoint import Layout, latest_manifest
from microbatch.joins import TableJoin, fields
from microbatch.keygroups import KeyGroupRange, encode_key, key_group_of_bytes
from microbatch.runtime import BatchRunner, JsonSchema, KafkaSource, ParquetSink, Pipeline
from microbatch.runtime import side_columns as side_columns_module
from microbatch.runtime.process import Handled, KeyedBatch
from microbatch.runtime.records import BatchRecord
from microbatch.runtime.side_columns import RecordsOnUse, SideColumns, input_schemas
from microbatch.settings import Settings
from microbatch.sinks import read_parquet_sink
from microbatch.state.backend import KeyedStateBackend
from microbatch.state.codec import encode_values
from microbatch.storage import open_store
from microbatch.testing import ProcessHarness, sided
from tests.unit.dataflow.test_column_steps_of_several_sources import (
    AUCTION,
    PERSON,
    STATES,
    Topics,
    auction,
    new_flow,
    outputs,
    person,
    run,
)
from tests.unit.dataflow.test_joins_at_once import crash_then_rescale
from tests.unit.runtime.test_protocol import InProcess

PICK = fields(left={"auction": "id", "seller": "seller"}, right=["name", "city", "state"])


def suggestions(root: Path, how: str, column_wise: bool) -> Pipeline:
    """Nexmark q3's shape, with a ``fields`` select (column-wise) or the same select as
    a plain function (record by record)."""
    flow = new_flow(root)
    auctions = flow.source(KafkaSource(topics=("auctions",), value_schema=AUCTION))
    people = flow.source(KafkaSource(topics=("people",), value_schema=PERSON))
    auctions = auctions.where(pc.field("category") == 10).select("id", "seller", "date_time")
    people = people.where(pc.field("state").isin(STATES)).select(
        "id", "name", "city", "state", "date_time"
    )
    select = PICK if column_wise else (lambda a, p: PICK(a, p))
    join = TableJoin(how=how, select=select)
    auctions.key_by("seller").join(people.key_by("id"), join, uid="q3").to(
        ParquetSink("out", str(root / "out"))
    )
    return flow.build()


def batches(log: Topics) -> list[Any]:
    """Sellers first; then auctions only (values read back from state); then sellers
    who move city in the batch of their auctions, people who are no sellers, and
    records that are dead letters."""
    return [
        lambda: (log.send("people", *(person(i) for i in range(20))),
                 log.send("auctions", *(auction(i) for i in range(30)))),
        lambda: log.send("auctions", *(auction(i) for i in range(30, 90))),
        lambda: (log.send("people", *(person(i, city=f"new{i}") for i in range(0, 30, 2)),
                          person(31, state=7)),
                 log.send("auctions", *(auction(i) for i in range(90, 150)),
                          auction(150, seller=None))),
    ]  # fmt: skip


@pytest.mark.parametrize("how", ["inner", "left"])
def test_a_column_wise_table_join_gives_what_the_record_wise_join_gives(
    tmp_path: Path, how: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    got, counters = {}, {}
    for column_wise in (False, True):
        if column_wise:  # it must not fall back to records: decoding them fails the test

            def no_records(self: Any) -> Any:
                raise AssertionError("the column-wise join decoded its records")

            monkeypatch.setattr(side_columns_module.RecordsOnUse, "_all", no_records)
        root = tmp_path / f"{how}-{column_wise}"
        log = Topics({"auctions": 2, "people": 2})
        pipeline = suggestions(root, how, column_wise)
        settings = dataclasses.replace(Settings.from_env(), spark_master="local[1]")
        for n, produce in enumerate(batches(log)):
            produce()
            runner = BatchRunner(None, pipeline, settings, executor=InProcess(log), broker=log)
            if column_wise:  # batch 2 crashes in stage 2 and is replayed, batch 3 rescales
                crash_then_rescale(runner, n)
            else:
                runner.run()
        got[column_wise] = outputs(root)
        manifest = latest_manifest(open_store(pipeline.checkpoints, settings), Layout())
        stats = BatchRecord.of(manifest).stats
        counters[column_wise] = collections.Counter()
        for instance in stats.instances if stats else ():
            counters[column_wise].update(instance.counters)

    rows, dead = got[True]
    assert rows == got[False][0]
    assert dead == got[False][1]
    as_columns = {k: v for k, v in counters[True].items() if k.endswith("keys_as_columns")}
    assert sum(as_columns.values()) > 20, counters[True]  # batch 3's keys, on 3 instances
    assert not any(k.endswith("keys_as_columns") for k in counters[False])
    found = [json.loads(r) for r in rows]
    moved = {r["auction"] for r in found if (r["city"] or "").startswith("new")}
    # sellers 0, 2, ... 28 of states kept moved in batch 3: its auctions see the new city
    # (auction i is id 500 + i, of category 10 unless i % 3 == 0, sold by seller i % 30,
    # who is in a kept state unless seller % 4 == 0)
    assert moved == {500 + i for i in range(90, 150) if i % 3 and i % 2 == 0 and i % 30 % 4}
    matched = sorted(r["auction"] for r in found if r["name"] is not None)
    # sellers 0-19 from batch 1 on; 20-29 only in batch 3, and only the even ones
    assert matched == [500 + i for i in range(150) if i % 3 and i % 30 % 4
                       and (i % 30 < 20 or (i >= 90 and i % 2 == 0))]  # fmt: skip
    unmatched = sum(1 for i in range(150) if i % 3) - len(matched)
    assert len(found) - len(matched) == (0 if how == "inner" else unmatched)
    assert sorted(d[0] for d in dead) == ["schema_mismatch", "schema_mismatch"]


def test_each_side_of_a_join_of_declared_sources_has_the_schema_of_its_column_steps(
    tmp_path: Path,
) -> None:
    schemas = input_schemas(suggestions(tmp_path, "inner", True), "q3")
    assert schemas[0] == pa.schema([("id", pa.int64()), ("seller", pa.int64()),
                                    ("date_time", pa.int64())])  # fmt: skip
    assert schemas[1].names == ["id", "name", "city", "state", "date_time"]


def test_a_side_reshaped_record_by_record_has_no_schema(tmp_path: Path) -> None:
    flow = new_flow(tmp_path)
    auctions = flow.source(KafkaSource(topics=("auctions",), value_schema=AUCTION))
    people = flow.source(KafkaSource(topics=("people",), value_schema=PERSON))
    people = people.map(lambda p: {**p, "extra": 1})
    auctions.key_by("seller").join(people.key_by("id"), TableJoin(select=PICK), uid="q3").to(
        ParquetSink("out", str(tmp_path / "out"))
    )
    assert list(input_schemas(flow.build(), "q3")) == [0]


def test_a_batch_without_table_records_reads_undeclared_stored_values_as_columns() -> None:
    """No declared schema on either side: the first batch's columns are read off its
    records; the second has only stream records, and the stored values' columns are read
    off the stored values — the same rows as the join of dicts, both batches on columns."""
    join = TableJoin(how="left", select=fields(left=["order"], right=["city"]))
    by_dicts = ProcessHarness(TableJoin(how="left", select=lambda o, c: join.select(o, c)))
    backend = KeyedStateBackend(8, KeyGroupRange(0, 7))
    batches = [
        ([("c1", {"order": 1}), ("c2", {"order": 2})], [("c1", {"city": "Oslo"})]),
        ([("c1", {"order": 3}), ("c3", {"order": 4})], []),
    ]
    for orders, customers in batches:
        want = by_dicts.batch(sided(orders, customers)).emitted
        handled = on_columns(join, backend, orders, customers)
        assert handled is not None and handled.columns is not None
        assert tuple(handled.columns.to_pylist()) == want
    assert want == ({"order": 3, "city": "Oslo"}, {"order": 4, "city": None})


def on_columns(
    join: TableJoin, backend: KeyedStateBackend, stream: list, table: list
) -> Handled | None:
    """``process_batch`` of one batch given as columns (keys in the order of their bytes,
    each key's table records first), on ``backend``'s state."""
    tagged = sorted(
        [(encode_key(k), 1, i, r) for i, (k, r) in enumerate(table)]
        + [(encode_key(k), 0, i, r) for i, (k, r) in enumerate(stream)],
        key=lambda x: (x[0], -x[1], x[2]),
    )
    key_bytes = sorted({kb for kb, *_ in tagged})
    bounds = np.searchsorted([kb for kb, *_ in tagged], key_bytes, side="left")
    bounds = np.append(bounds, len(tagged)).astype(np.int64)
    records = [r for *_, r in tagged]
    sides = np.array([s for _, s, *_ in tagged], dtype=np.int8)
    payloads = pa.array(encode_values(records), pa.binary())
    batch = KeyedBatch.on_backend(
        backend, [key_group_of_bytes(kb, 8) for kb in key_bytes], key_bytes,
        RecordsOnUse(lambda i, j: records[i:j], len(records)), bounds, sides, None, None,
        SideColumns(payloads, sides, {}),
    )  # fmt: skip
    return join.process_batch(batch)


RANKED = fields(left={"auction": "id"}, right=["name", "rank"])


def test_a_sink_without_a_schema_gets_the_types_records_give(tmp_path: Path) -> None:
    """A declared ``int`` (int32) field joined on columns reaches a schemaless Parquet sink
    as int64, as the same records would: batches that fall back to records write the
    same types."""
    ranked = JsonSchema({**PERSON.fields, "rank": "int"})
    types = {}
    for column_wise in (True, False):
        root = tmp_path / str(column_wise)
        flow = new_flow(root)
        auctions = flow.source(KafkaSource(topics=("auctions",), value_schema=AUCTION))
        people = flow.source(KafkaSource(topics=("people",), value_schema=ranked))
        join = TableJoin(select=RANKED if column_wise else (lambda a, p: RANKED(a, p)))
        auctions.key_by("seller").join(people.key_by("id"), join, uid="q3").to(
            ParquetSink("out", str(root / "out"))
        )
        log = Topics({"auctions": 1, "people": 1})

        def produce(log: Topics = log) -> None:
            log.send("people", *(person(i, rank=i) for i in range(10)))
            log.send("auctions", *(auction(i) for i in range(10)))

        run(flow.build(), log, [produce])
        table = read_parquet_sink(str(root / "out"))
        types[column_wise] = dict(zip(table.column_names, table.schema.types, strict=True))
        assert table.num_rows > 0
    assert types[True] == types[False]
    assert types[True]["rank"] == pa.int64()


def test_a_changelog_s_tombstones_are_deletes_on_columns_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """People as a changelog with Kafka tombstones (``tombstones=True``): a batch of
    deletes and updates, then one whose values are read back from state, joined on
    columns through a crash and a rescale, give the rows of the same join of dicts —
    no record decoded, every key on columns, deleted sellers' auctions unmatched."""

    def changes(log: Topics) -> list[Any]:
        return [
            lambda: (log.send("people", *((str(i).encode(), person(i)) for i in range(20))),
                     log.send("auctions", *(auction(i) for i in range(30)))),
            lambda: (log.send("people", *((str(i).encode(), None) for i in range(0, 20, 2)),
                              (b"4", person(4, city="back"))),
                     log.send("auctions", *(auction(i) for i in range(30, 90)))),
            lambda: log.send("auctions", *(auction(i) for i in range(90, 150))),
        ]  # fmt: skip

    got, counters = {}, {}
    for column_wise in (False, True):
        if column_wise:

            def no_records(self: Any) -> Any:
                raise AssertionError("the column-wise join decoded its records")

            monkeypatch.setattr(side_columns_module.RecordsOnUse, "_all", no_records)
        root = tmp_path / str(column_wise)
        flow = new_flow(root)
        auctions = flow.source(KafkaSource(topics=("auctions",), value_schema=AUCTION))
        people = flow.source(KafkaSource(
            topics=("people",), value_schema=PERSON, tombstones=True, tombstone_key=int
        ))  # fmt: skip
        join = TableJoin(how="left", select=PICK if column_wise else (lambda a, p: PICK(a, p)))
        auctions.key_by("seller").join(people.key_by("id"), join, uid="q3").to(
            ParquetSink("out", str(root / "out"))
        )
        pipeline, log = flow.build(), Topics({"auctions": 2, "people": 1})
        settings = dataclasses.replace(Settings.from_env(), spark_master="local[1]")
        counters[column_wise] = collections.Counter()
        for n, produce in enumerate(changes(log)):
            produce()
            runner = BatchRunner(None, pipeline, settings, executor=InProcess(log), broker=log)
            crash_then_rescale(runner, n) if column_wise else runner.run()
            manifest = latest_manifest(open_store(pipeline.checkpoints, settings), Layout())
            stats = BatchRecord.of(manifest).stats
            for instance in stats.instances if stats else ():
                counters[column_wise].update(instance.counters)
        got[column_wise] = outputs(root)

    assert got[True] == got[False]
    keys = sum(v for k, v in counters[True].items() if k.endswith(".keys") or k == "keys")
    as_columns = sum(v for k, v in counters[True].items() if k.endswith("keys_as_columns"))
    assert as_columns == keys > 40, counters[True]
    found = [json.loads(r) for r in got[True][0]]
    late = {r["auction"] - 500: r["name"] for r in found if r["auction"] >= 530}
    assert {i for i, name in late.items() if name is None} == {
        i for i in range(30, 150) if i % 30 < 20 and i % 2 == 0 and i % 30 != 4
    } | {i for i in range(30, 150) if i % 30 >= 20}
    assert all(r["city"] == "back" for r in found if r["auction"] >= 530 and r["seller"] == 4)
