"""The PostgreSQL sink on the run's real PostgreSQL: one transaction per batch, reruns,
racing and stalled publishers write nothing twice, backfills replace in one transaction,
and a table or row that does not fit fails with the column named."""

from __future__ import annotations

import datetime as dt
import decimal
import itertools
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pyarrow as pa
import pytest
from psycopg.conninfo import make_conninfo

from microbatch.checkpoint import Layout
from microbatch.errors import ConfigError, ExitCode, ServiceError, SinkError, exit_code
from microbatch.settings import Settings
from microbatch.sinks import PostgresSink, PublishContext, StageContext
from microbatch.sinks.postgres import PostgresTarget
from microbatch.sinks.replacement import after_batch
from microbatch.storage import open_store

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[3]
SCHEMA = pa.schema(
    [
        pa.field("user", pa.string(), nullable=False),
        ("clicks", pa.int64()),
        ("last_url", pa.string()),
    ]
)
_tables = itertools.count()


@pytest.fixture(scope="module")
def dsn(postgres_dsn: str) -> str:
    return postgres_dsn


@pytest.fixture
def table() -> str:
    """A table name no other test uses."""
    return f"t{next(_tables)}_{os.getpid()}"


def sink(dsn: str, table: str, **kw: Any) -> PostgresSink:
    return PostgresSink("out", table, kw.pop("schema", SCHEMA), dsn=dsn, **{"key": "user", **kw})


def target(s: PostgresSink, pipeline: str = "pipe") -> PostgresTarget:
    return s.target(Settings.from_env(), pipeline)


def publish(t: PostgresTarget, batch_id: int, *instances: list[dict], **kw: Any) -> bool:
    tables = [pa.Table.from_pylist(rows, schema=t.sink.schema) for rows in instances]
    return t.publish(batch_id, tables, **kw)


def query(dsn: str, sql: str) -> list[tuple]:
    with psycopg.connect(dsn) as conn:
        return conn.execute(sql).fetchall()


def rows(dsn: str, table: str) -> list[tuple]:
    return query(
        dsn, f'SELECT "user", clicks, last_url, _microbatch_batch FROM {table} ORDER BY 1, 2'
    )


def test_upsert_keeps_the_last_row_per_key_and_a_rerun_writes_nothing(dsn: str, table: str) -> None:
    t = target(sink(dsn, table))
    first = [
        {"user": "a", "clicks": 1, "last_url": "/1"},
        {"user": "b", "clicks": 1, "last_url": "/x"},
    ]
    second = [{"user": "a", "clicks": 2, "last_url": "/2"}]  # a later instance: it wins
    assert publish(t, 0, first, second)
    assert not publish(t, 0, first, second)  # the rerun after a crash
    assert publish(t, 1, [{"user": "b", "clicks": 5, "last_url": None}])
    assert rows(dsn, table) == [("a", 2, "/2", 0), ("b", 5, None, 1)]
    # batch 0's keys were new: straight COPY; batch 1 found 'b' there: the merge
    commits = query(
        dsn,
        "SELECT batch_id, kind, rows, method FROM microbatch_commits "
        f"WHERE target = 'public.{table}' ORDER BY 1",
    )
    assert commits == [(0, "batch", 2, "copy"), (1, "batch", 1, "merge")]
    assert t.last_published() == 1
    # the table the sink created: the key is the primary key
    assert query(
        dsn, f"SELECT count(*) FROM pg_index WHERE indrelid = '{table}'::regclass AND indisprimary"
    ) == [(1,)]


def test_within_one_instance_the_later_emitted_row_wins(dsn: str, table: str) -> None:
    t = target(sink(dsn, table))
    emitted = [
        {"user": u, "clicks": n, "last_url": f"/{n}"}
        for u, n in zip("abaab", range(5), strict=True)
    ]
    assert publish(t, 0, emitted)
    assert rows(dsn, table) == [("a", 3, "/3", 0), ("b", 4, "/4", 0)]
    # after a merge, the next batch goes straight to the merge, with the same result
    assert publish(t, 1, [{"user": "a", "clicks": 9, "last_url": None}])
    assert publish(t, 2, [{"user": "c", "clicks": 1, "last_url": None}])
    assert rows(dsn, table) == [("a", 9, None, 1), ("b", 4, "/4", 0), ("c", 1, None, 2)]
    methods = query(
        dsn,
        f"SELECT method FROM microbatch_commits WHERE target = 'public.{table}' ORDER BY batch_id",
    )
    assert methods == [("copy",), ("merge",), ("merge",)]


def test_two_publishers_racing_on_one_batch_write_it_once(dsn: str, table: str) -> None:
    t = target(sink(dsn, table, mode="append", key=()))
    batch = [[{"user": f"u{i}", "clicks": i, "last_url": None} for i in range(500)]]
    results: list[bool] = []
    threads = [
        threading.Thread(target=lambda: results.append(publish(t, 0, *batch))) for _ in range(4)
    ]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert sorted(results) == [False, False, False, True]
    assert query(dsn, f'SELECT count(*), count(DISTINCT "user") FROM {table}') == [(500, 500)]


def test_a_backfill_replaces_the_undone_batches_rows_in_one_transaction(
    dsn: str, table: str
) -> None:
    t = target(sink(dsn, table, mode="append", key=()))
    old = {"user": "a", "clicks": 1, "last_url": "old"}
    publish(t, 0, [old], end_offsets={"clicks:0": 10})
    publish(t, 1, [old, old], end_offsets={"clicks:0": 20})
    # a rewind to checkpoint 0's start, committed as checkpoint 2, undoes batches 0-1
    assert t.publish_rewind(2, [0, 1])
    assert not t.publish_rewind(2, [0, 1])
    awaiting = t.sink.awaiting_replacement(Settings.from_env(), [])
    assert awaiting == {"0": {"clicks:0": 10}, "1": {"clicks:0": 20}}
    # the recomputed batch 3 reads offsets up to 10 again: it replaces batch 0 only
    supersedes, awaiting = after_batch(awaiting, {"clicks:0": 10})
    new = {"user": "a", "clicks": 7, "last_url": "new"}
    publish(t, 3, [new], end_offsets={"clicks:0": 10}, supersedes=supersedes)
    assert supersedes == [0] and list(awaiting) == ["1"]
    assert rows(dsn, table) == [("a", 1, "old", 1), ("a", 1, "old", 1), ("a", 7, "new", 3)]
    supersedes, awaiting = after_batch(awaiting, {"clicks:0": 20})
    publish(t, 4, [new], end_offsets={"clicks:0": 20}, supersedes=supersedes)
    assert rows(dsn, table) == [("a", 7, "new", 3), ("a", 7, "new", 4)]
    assert t.sink.awaiting_replacement(Settings.from_env(), []) == {}


def test_an_upsert_sink_is_replaced_by_the_replayed_batches_themselves(
    dsn: str, table: str
) -> None:
    s = sink(dsn, table)
    t = target(s)
    publish(t, 0, [{"user": "a", "clicks": 1, "last_url": "/old"}], end_offsets={"c:0": 5})
    t.publish_rewind(1, [0])
    assert s.awaiting_replacement(Settings.from_env(), [0]) == {}
    publish(t, 2, [{"user": "a", "clicks": 3, "last_url": "/new"}], end_offsets={"c:0": 5})
    assert rows(dsn, table) == [("a", 3, "/new", 2)]


def test_stage_then_publish_through_the_checkpoint_store(
    dsn: str, table: str, tmp_path: Path
) -> None:
    s = sink(dsn, table)
    store, settings = open_store(str(tmp_path), Settings.from_env()), Settings.from_env()
    staged = []
    for instance, user in enumerate(("a", "b")):
        ctx = StageContext("pipe", 0, instance, settings, store, Layout(), attempt="x1")
        staged.append(s.stage(ctx, [{"user": user, "clicks": instance, "last_url": None}]))
    assert s.stage(StageContext("pipe", 0, 2, settings, store, Layout(), "x1"), []) is None
    assert query(dsn, f"SELECT count(*) FROM {table}") == [(0,)]  # created, nothing visible yet
    ctx = PublishContext("pipe", 0, settings, store, Layout(), tuple(staged), {"c:0": 2})
    s.publish(ctx)
    s.publish(ctx)
    assert rows(dsn, table) == [("a", 0, None, 0), ("b", 1, None, 0)]
    assert s.last_published(settings, "pipe") == 0


def test_a_null_key_fails_the_batch_before_it_commits(dsn: str, table: str, tmp_path: Path) -> None:
    s = sink(dsn, table)
    settings = Settings.from_env()
    ctx = StageContext("pipe", 7, 0, settings, open_store(str(tmp_path), settings), Layout(), "a")
    with pytest.raises(
        SinkError, match=r"batch 7: column 'user' is NULL in 1 row\(s\).*NOT NULL key"
    ):
        s.stage(ctx, [{"user": "a", "clicks": 1}, {"user": None, "clicks": 2}])


def test_a_row_the_table_refuses_names_table_column_key_and_batch(dsn: str, table: str) -> None:
    t = target(sink(dsn, table))
    publish(t, 0, [{"user": "a", "clicks": 1, "last_url": "/"}])
    with psycopg.connect(dsn) as conn:
        conn.execute(f"ALTER TABLE {table} ADD CONSTRAINT positive CHECK (clicks > 0)")
        conn.execute(f"ALTER TABLE {table} ALTER COLUMN last_url SET NOT NULL")
    good = [{"user": f"u{i:02}", "clicks": 1, "last_url": "/"} for i in range(40)]
    with pytest.raises(
        SinkError,
        match=rf"table public\.{table}\).*batch 1: the table refuses the row with key "
        r"\{'user': 'u17'\}: constraint 'positive'.*not published",
    ):
        publish(t, 1, good, [{"user": "u17", "clicks": -1, "last_url": "/"}])
    with pytest.raises(
        SinkError, match=r"batch 1: .*key \{'user': 'u30'\}: column 'last_url': null value"
    ):
        publish(t, 1, good, [{"user": "u30", "clicks": 1, "last_url": None}])
    assert rows(dsn, table) == [("a", 1, "/", 0)]  # nothing of batch 1, not even its commit
    assert t.last_published() == 0
    assert query(dsn, f"SELECT to_regclass('{table}_refused')") == [(None,)]


def test_a_table_that_does_not_fit_is_refused_naming_the_column(dsn: str, table: str) -> None:
    with psycopg.connect(dsn) as conn:
        conn.execute(
            f'CREATE TABLE {table} ("user" text PRIMARY KEY, clicks text, '
            "_microbatch_batch bigint NOT NULL)"
        )
    with pytest.raises(ConfigError, match=r"column 'clicks' is text in the table but bigint"):
        publish(target(sink(dsn, table)), 0, [{"user": "a", "clicks": 1, "last_url": None}])


def test_a_new_nullable_column_is_added_to_the_table(dsn: str, table: str) -> None:
    publish(target(sink(dsn, table, schema=SCHEMA.remove(2))), 0, [{"user": "a", "clicks": 1}])
    publish(target(sink(dsn, table)), 1, [{"user": "b", "clicks": 2, "last_url": "/b"}])
    assert rows(dsn, table) == [("a", 1, None, 0), ("b", 2, "/b", 1)]


def test_upsert_into_a_table_without_a_unique_key_is_refused(dsn: str, table: str) -> None:
    with psycopg.connect(dsn) as conn:
        conn.execute(
            f'CREATE TABLE {table} ("user" text, clicks bigint, last_url text, '
            "_microbatch_batch bigint NOT NULL)"
        )
    with pytest.raises(ConfigError, match=r"unique index on exactly \(user\).*ADD PRIMARY KEY"):
        publish(target(sink(dsn, table)), 0, [{"user": "a", "clicks": 1, "last_url": None}])


def test_a_table_another_pipeline_writes_is_refused_before_any_work(dsn: str, table: str) -> None:
    publish(target(sink(dsn, table), "billing"), 0, [{"user": "a", "clicks": 1, "last_url": None}])
    other = sink(dsn, table)
    with pytest.raises(
        ConfigError, match=r"pipeline 'fraud'.*already written by pipeline 'billing'"
    ):
        other.last_published(Settings.from_env(), "fraud")
    with pytest.raises(ConfigError, match="already written by pipeline 'billing'"):
        publish(target(other, "fraud"), 0, [{"user": "z", "clicks": 9, "last_url": None}])
    assert rows(dsn, table) == [("a", 1, None, 0)]


def test_a_server_that_does_not_answer_is_service_unreachable(table: str) -> None:
    t = target(sink("postgresql://u:secret@127.0.0.1:1/db", table))
    with pytest.raises(ServiceError, match="PostgreSQL did not answer") as caught:
        publish(t, 0, [{"user": "a", "clicks": 1, "last_url": None}])
    assert exit_code(caught.value) is ExitCode.SERVICE_UNREACHABLE
    assert "secret" not in repr(t.sink)


def test_every_supported_type_reads_back_as_written(dsn: str, table: str) -> None:
    schema = pa.schema(
        [
            pa.field("id", pa.int32(), nullable=False),
            ("text", pa.string()),
            ("flag", pa.bool_()),
            ("ratio", pa.float64()),
            ("at", pa.timestamp("us", tz="UTC")),
            ("day", pa.date32()),
            ("price", pa.decimal128(10, 2)),
            ("blob", pa.binary()),
            ("tags", pa.list_(pa.string())),
            ("counts", pa.list_(pa.int64())),
        ]
    )
    tricky = ['x"y', "b\\c", "d,e", None, "", "{}", "NULL"]
    written = [
        {
            "id": 1,
            "text": 'q"u,o\nte',
            "flag": True,
            "ratio": 1e300,
            "at": dt.datetime(2026, 1, 2, 3, 4, 5, 678901, tzinfo=dt.UTC),
            "day": dt.date(2026, 11, 26),
            "price": decimal.Decimal("-4.50"),
            "blob": b"\x00\xff",
            "tags": tricky,
            "counts": [1, None, 3],
        },
        {"id": 2, "text": "", "tags": [], "counts": None},
        {"id": 3},
    ]
    s = PostgresSink("out", table, schema, key="id", dsn=dsn)
    publish(target(s), 0, written)
    cols = ", ".join(f'"{n}"' for n in schema.names)
    got = query(dsn, f"SELECT {cols} FROM {table} ORDER BY id")
    expected = pa.Table.from_pylist(written, schema=schema).to_pylist()
    assert [dict(zip(schema.names, row, strict=True)) for row in got] == expected
    types = query(
        dsn,
        "SELECT format_type(atttypid, atttypmod) FROM pg_attribute "
        f"WHERE attrelid = '{table}'::regclass AND attnum > 0 ORDER BY attnum",
    )
    assert [t for (t,) in types] == [
        "integer", "text", "boolean", "double precision", "timestamp with time zone",
        "date", "numeric(10,2)", "bytea", "text[]", "bigint[]", "bigint",
    ]  # fmt: skip


def test_a_sink_declared_wrong_is_refused_when_built() -> None:
    with pytest.raises(ConfigError, match="mode='upsert' needs key"):
        PostgresSink("out", "t", SCHEMA)
    nested = pa.schema([("tags", pa.list_(pa.list_(pa.string())))])
    with pytest.raises(ConfigError, match=r"column 'tags' has type list<item: list<item"):
        PostgresSink("out", "t", nested, mode="append")
    with pytest.raises(ConfigError, match=r"not 'table' or 'schema\.table'"):
        PostgresSink("out", "a.b.c", SCHEMA, key="user")


PUBLISHER = """
import json, sys
import pyarrow as pa
from microbatch.settings import Settings
from microbatch.sinks import PostgresSink
schema = pa.schema([pa.field("user", pa.string(), nullable=False), ("clicks", pa.int64()),
                    ("last_url", pa.string())])
dsn, table = sys.argv[1], sys.argv[2]
s = PostgresSink("out", table, schema, dsn=dsn, mode="append", stall_timeout_s=1)
rows = pa.Table.from_pylist(json.loads(sys.argv[3]), schema=schema)
print(s.target(Settings.from_env(), "pipe").publish(0, [rows]), flush=True)
"""


@pytest.fixture
def stalled_publisher(dsn: str, table: str) -> Iterator[subprocess.Popen]:
    """A process publishing batch 0, stopped inside its open transaction."""
    batch = [{"user": f"u{i}", "clicks": i, "last_url": None} for i in range(100)]
    env = {**os.environ, "MICROBATCH_PAUSE_AT": "in_postgres_transaction"}
    proc = subprocess.Popen(
        [sys.executable, "-c", PUBLISHER, dsn, table, json.dumps(batch)],
        env=env,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 30
    while not _stopped(proc.pid):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)
    yield proc
    if proc.poll() is None:
        proc.kill()
        proc.communicate()


def _stopped(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "T"


def test_a_publisher_killed_inside_its_transaction_leaves_nothing_then_the_rerun_publishes(
    dsn: str, table: str, stalled_publisher: subprocess.Popen
) -> None:
    # the table is created in the open transaction too: nothing of it is visible yet
    assert query(dsn, f"SELECT to_regclass('{table}')") == [(None,)]
    stalled_publisher.send_signal(signal.SIGKILL)
    stalled_publisher.wait()
    t = target(PostgresSink("out", table, SCHEMA, dsn=dsn, mode="append"))
    batch = [{"user": f"u{i}", "clicks": i, "last_url": None} for i in range(100)]
    assert publish(t, 0, batch)
    assert query(dsn, f'SELECT count(*), count(DISTINCT "user") FROM {table}') == [(100, 100)]


def test_a_stalled_zombie_publisher_loses_its_transaction_and_writes_nothing(
    dsn: str, table: str, stalled_publisher: subprocess.Popen
) -> None:
    # The publish waits for the table's lock until PostgreSQL ends the zombie's session
    # (its stall_timeout_s=1). This session gives up a lock wait after 15 s, so a zombie
    # that keeps its lock (no or a longer stall timeout) fails the publish, LockNotAvailable.
    waiting = make_conninfo(dsn, options="-c lock_timeout=15s")
    t = target(PostgresSink("out", table, SCHEMA, dsn=waiting, mode="append"))
    batch = [{"user": f"u{i}", "clicks": i, "last_url": None} for i in range(100)]
    assert publish(t, 0, batch)
    stalled_publisher.send_signal(signal.SIGCONT)
    out, err = stalled_publisher.communicate(timeout=30)
    assert stalled_publisher.returncode != 0, (out, err)
    assert "idle-in-transaction timeout" in err, err  # PostgreSQL ended it, nothing else
    assert query(dsn, f'SELECT count(*), count(DISTINCT "user") FROM {table}') == [(100, 100)]
    assert query(
        dsn, f"SELECT count(*) FROM microbatch_commits WHERE target = 'public.{table}'"
    ) == [(1,)]


def refused_rows(dsn: str, table: str) -> list[tuple]:
    """The refused table's coordinates and errors; the row's JSON parsed back."""
    got = query(
        dsn,
        "SELECT pipeline, sink, batch_id, row_key::text, row_json::text, sqlstate, "
        f"constraint_name, column_name FROM {table}_refused ORDER BY batch_id, row_key::text",
    )
    return [(*r[:4], json.loads(r[4]), *r[5:]) for r in got]


def test_refused_rows_go_to_the_refused_table_once_and_the_batch_publishes_the_others(
    dsn: str, table: str
) -> None:
    schema = SCHEMA.set(1, pa.field("clicks", pa.int64(), nullable=False))
    t = target(sink(dsn, table, schema=schema, on_refused="dead_letter"))
    with psycopg.connect(dsn) as conn, conn.transaction():
        t.prepare(conn)
        conn.execute(f"ALTER TABLE {table} ADD CONSTRAINT positive CHECK (clicks > 0)")
    good = [{"user": f"u{i:03}", "clicks": i + 1, "last_url": None} for i in range(100)]
    not_null = {"user": "u010", "clicks": None, "last_url": None}  # staging lets it through
    check = {"user": "u050", "clicks": -5, "last_url": None}
    nul = {"user": "u099", "clicks": 7, "last_url": "nul\x00byte"}  # text refuses NUL
    # batch 0: new keys, the straight COPY fails; the refused rows are searched for
    assert publish(t, 0, good, [not_null, check, nul], end_offsets={"c:0": 10})
    assert not publish(t, 0, good, [not_null, check, nul])  # a retry writes nothing again
    written = {user: clicks for user, clicks, _, _ in rows(dsn, table)}
    assert len(written) == 97 and {"u010", "u050", "u099"}.isdisjoint(written)
    assert refused_rows(dsn, table) == [
        ("pipe", "out", 0, '{"user": "u010"}', not_null, "23502", None, "clicks"),
        ("pipe", "out", 0, '{"user": "u050"}', check, "23514", "positive", None),
        ("pipe", "out", 0, '{"user": "u099"}', nul, "22021", None, None),
    ]
    # batch 1: keys already there (the merge); the refused update keeps the old value
    publish(t, 1, [{"user": "u001", "clicks": 0, "last_url": "/0"}, good[2] | {"clicks": 9}])
    written = {user: clicks for user, clicks, _, _ in rows(dsn, table)}
    assert (written["u001"], written["u002"]) == (2, 9)
    assert refused_rows(dsn, table)[-1][2:] == (
        1, '{"user": "u001"}', {"user": "u001", "clicks": 0, "last_url": "/0"}, "23514",
        "positive", None,
    )  # fmt: skip
    commits = query(
        dsn,
        "SELECT batch_id, rows, method FROM microbatch_commits "
        f"WHERE target = 'public.{table}' ORDER BY 1",
    )
    assert commits == [(0, 97, "merge"), (1, 1, "merge")]


def test_a_backfill_replaces_the_refused_rows_of_the_batches_it_recomputes(
    dsn: str, table: str
) -> None:
    s = sink(dsn, table, on_refused="dead_letter", refused_table=f"{table}_bad")
    t = target(s)
    with psycopg.connect(dsn) as conn, conn.transaction():
        t.prepare(conn)
        conn.execute(f"ALTER TABLE {table} ADD CONSTRAINT positive CHECK (clicks > 0)")
    b = {"user": "b", "clicks": 1, "last_url": None}
    publish(t, 0, [{"user": "a", "clicks": -1, "last_url": None}, b], end_offsets={"c:0": 5})
    assert query(dsn, f"SELECT batch_id, row_key::text FROM {table}_bad") == [(0, '{"user": "a"}')]
    # a rewind undoes batch 0: its refused row awaits the batch that reads its input again
    assert t.publish_rewind(1, [0])
    assert s.awaiting_replacement(Settings.from_env(), []) == {"0": {"c:0": 5}}
    a = {"user": "a", "clicks": 3, "last_url": None}
    publish(t, 2, [a, b], end_offsets={"c:0": 5}, supersedes=[0])
    assert query(dsn, f"SELECT count(*) FROM {table}_bad") == [(0,)]
    assert rows(dsn, table) == [("a", 3, None, 2), ("b", 1, None, 2)]
    assert s.awaiting_replacement(Settings.from_env(), []) == {}


def test_an_error_no_row_causes_fails_the_batch_even_with_dead_letters(
    dsn: str, table: str
) -> None:
    t = target(sink(dsn, table, on_refused="dead_letter"))
    publish(t, 0, [{"user": "a", "clicks": 1, "last_url": None}])
    with psycopg.connect(dsn) as conn:
        conn.execute(f"ALTER TABLE {table} ADD CONSTRAINT positive CHECK (clicks > 0)")
        conn.execute(
            f"CREATE FUNCTION {table}_busy() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
            "IF NEW.clicks = 13 THEN RAISE EXCEPTION 'busy' USING ERRCODE = '55P03'; END IF; "
            "RETURN NEW; END $$"
        )
        conn.execute(
            f"CREATE TRIGGER busy BEFORE INSERT OR UPDATE ON {table} "
            f"FOR EACH ROW EXECUTE FUNCTION {table}_busy()"
        )
    batch = [
        {"user": "b", "clicks": 13, "last_url": None},  # the trigger fails: lock_not_available
        {"user": "c", "clicks": -1, "last_url": None},  # refused: the CHECK
        {"user": "d", "clicks": 4, "last_url": None},
    ]
    with pytest.raises(psycopg.errors.LockNotAvailable):
        publish(t, 1, batch)
    assert rows(dsn, table) == [("a", 1, None, 0)] and t.last_published() == 0
    assert query(dsn, f"SELECT count(*) FROM {table}_refused") == [(0,)]
    with psycopg.connect(dsn) as conn:
        conn.execute(f"DROP TRIGGER busy ON {table}")
    assert publish(t, 1, batch)  # the retry publishes the batch, its refused row once
    assert not publish(t, 1, batch)
    assert [r[0] for r in rows(dsn, table)] == ["a", "b", "d"]
    assert [r[2:4] for r in refused_rows(dsn, table)] == [(1, '{"user": "c"}')]
