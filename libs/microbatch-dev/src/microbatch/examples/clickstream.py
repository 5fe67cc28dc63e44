"""The example pipeline: clickstream sessionization with profile enrichment.

JSON clicks ``{"user_id", "page", "ts"}`` from Kafka → enriched with the user's profile
from an HTTP service (async I/O, retries) → keyed by user → sessions closed by a
30-minute event-time inactivity gap (timers) → closed sessions
``{"user_id", "session_start", "session_end", "clicks", "pages", "segment"}`` to Parquet,
to a Delta Lake table (``<root>/sessions_delta``) and to a Kafka topic; malformed clicks go
to the dead-letter topic.

:func:`reference_sessions` computes the expected sessions in plain Python, for the demo's
exactly-once check.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import pyarrow as pa

from microbatch.runtime import (
    DeadLetterSink,
    Enrichment,
    EventTime,
    KafkaSink,
    KafkaSource,
    KeyedProcessFunction,
    ParquetSink,
    Pipeline,
    ProcessContext,
)
from microbatch.sinks import DeltaSink, IcebergSink, PostgresSink

GAP_MS = 30 * 60 * 1000
SESSION_SCHEMA = pa.schema(
    [
        ("user_id", pa.string()),
        ("session_start", pa.int64()),
        ("session_end", pa.int64()),
        ("clicks", pa.int64()),
        ("pages", pa.list_(pa.string())),
        ("segment", pa.string()),
    ]
)


def merge_click(sessions: list[dict[str, Any]], click: dict[str, Any], gap_ms: int) -> list[dict]:
    """Add one click to a user's open sessions, merging every session it bridges.

    Two activities belong to one session when they are less than ``gap_ms`` apart.
    Sessions are dicts ``{start, end, clicks, pages, segment}``; the result is sorted."""
    ts = click["ts"]
    new = {
        "start": ts,
        "end": ts,
        "clicks": 1,
        "pages": [click["page"]],
        "segment": click.get("segment"),
    }
    keep = list(sessions)
    # Merge every session the new one reaches, until none does (a click can bridge two).
    changed = True
    while changed:
        changed = False
        for s in list(keep):
            if s["start"] - gap_ms < new["end"] and new["start"] < s["end"] + gap_ms:
                keep.remove(s)
                new = _merged(s, new)
                changed = True
    return sorted([*keep, new], key=lambda s: s["start"])


def _merged(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    return {
        "start": min(a["start"], b["start"]),
        "end": max(a["end"], b["end"]),
        "clicks": a["clicks"] + b["clicks"],
        "pages": sorted(set(a["pages"]) | set(b["pages"])),
        "segment": a["segment"] or b["segment"],
    }


def session_row(user_id: str, s: dict[str, Any]) -> dict[str, Any]:
    return {
        "user_id": user_id,
        "session_start": s["start"],
        "session_end": s["end"],
        "clicks": s["clicks"],
        "pages": sorted(s["pages"]),
        "segment": s["segment"],
    }


class Sessionize(KeyedProcessFunction):
    """Open sessions per user in value state; a timer at ``end + gap`` closes each."""

    def __init__(self, gap_ms: int = GAP_MS) -> None:
        self.gap_ms = gap_ms

    def process(self, key: Any, records: Sequence[Any], ctx: ProcessContext) -> None:
        state = ctx.value("sessions")
        sessions = state.get([])
        before = {s["end"] + self.gap_ms for s in sessions}
        for r in sorted(records, key=lambda r: r["ts"]):
            sessions = merge_click(sessions, r, self.gap_ms)
        after = {s["end"] + self.gap_ms for s in sessions}
        for t in before - after:
            ctx.delete_timer(t)
        for t in after - before:
            ctx.register_timer(t)
        state.set(sessions)

    def on_timer(self, key: Any, timestamp_ms: int, ctx: ProcessContext) -> None:
        state = ctx.value("sessions")
        open_, closed = [], []
        for s in state.get([]):
            (closed if s["end"] + self.gap_ms <= timestamp_ms else open_).append(s)
        for s in closed:
            ctx.emit(session_row(key, s))
        if open_:
            state.set(open_)
        else:
            state.clear()


class ProfileClient:
    """``invoke`` for the async operator: GET the user's profile, add ``segment``.

    The aiohttp session is created lazily inside the batch's event loop and closed by the
    operator (``aclose``). A 5xx raises, so the retry strategy retries it."""

    def __init__(self, base_url: str) -> None:
        self.base_url = base_url.rstrip("/")
        self._session: Any = None

    async def __call__(self, record: dict[str, Any]) -> dict[str, Any]:
        import aiohttp

        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5))
        url = f"{self.base_url}/profiles/{record['user_id']}"
        async with self._session.get(url) as resp:
            if resp.status >= 500:
                raise ConnectionError(f"profile service answered {resp.status} for {url}")
            resp.raise_for_status()
            profile = await resp.json()
        return {**record, "segment": profile["segment"]}

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()


def is_transient(exc: BaseException) -> bool:
    """Worth retrying: the service was unavailable or the connection failed. A bug (say a
    click without ``user_id``) is not: it goes to the dead letters at once."""
    import asyncio

    import aiohttp

    return isinstance(exc, ConnectionError | aiohttp.ClientError | asyncio.TimeoutError)


def make_profile_operator(base_url: str, capacity: int = 200) -> Any:
    """A fresh async operator (called inside each Spark task's event loop)."""
    from microbatch.enrich import AsyncOperator, ExponentialBackoff, retry_on_exception

    return AsyncOperator(
        ProfileClient(base_url),
        mode="unordered",
        capacity=capacity,
        timeout_s=20.0,
        retry=ExponentialBackoff(
            initial_s=0.02,
            max_delay_s=0.5,
            multiplier=2.0,
            max_attempts=10,
            jitter=0.5,
            predicates=(retry_on_exception(is_transient),),
        ),
        on_failure="dead_letter",
    )


@dataclasses.dataclass(frozen=True)
class ClickstreamConfig:
    """Where the example pipeline reads and writes."""

    topic: str = "clicks"
    sessions_topic: str = "sessions"
    dead_letter_topic: str = "clicks.dlq"
    root: str = "s3://microbatch/clickstream"
    profile_url: str = "http://127.0.0.1:8765"
    parallelism: int = 2
    max_parallelism: int = 64
    allowed_lateness_s: float = 60.0
    idle_timeout_s: float = 30.0
    enrichment_deadline_s: float | None = 60.0
    #: Also upsert the sessions into this PostgreSQL table (the database:
    #: ``MICROBATCH_POSTGRES_DSN``); empty: no PostgreSQL sink.
    postgres_table: str = ""
    #: Also write the sessions to this Iceberg table (``namespace.name``, the embedded
    #: catalog under the microbatch home); empty: no Iceberg sink.
    iceberg_table: str = ""

    #: Environment variables (``MICROBATCH_CLICKSTREAM_<FIELD>``) override the fields.
    ENV_PREFIX = "MICROBATCH_CLICKSTREAM_"

    @classmethod
    def fresh(cls, bucket: str, label: str, run: str, **overrides: Any) -> ClickstreamConfig:
        """A namespace of its own (a demo run, a test): topics suffixed with ``run``, the
        root at ``s3://<bucket>/<label>-<run>``."""
        return cls(
            topic=f"clicks-{run}",
            sessions_topic=f"sessions-{run}",
            dead_letter_topic=f"clicks-dlq-{run}",
            root=f"s3://{bucket}/{label}-{run}",
            **overrides,
        )

    @classmethod
    def from_env(cls, bucket: str, env: Mapping[str, str] | None = None) -> ClickstreamConfig:
        """Defaults with the root in ``bucket``, overridden by ``MICROBATCH_CLICKSTREAM_*``."""
        env = os.environ if env is None else env
        values: dict[str, Any] = {"root": f"s3://{bucket}/clickstream"}
        for f in dataclasses.fields(cls):
            raw = env.get(cls.ENV_PREFIX + f.name.upper())
            if raw is None:
                continue
            kind = type(getattr(cls(), f.name))
            values[f.name] = kind(raw) if kind in (int, float) else raw
        return cls(**values)

    def to_env(self) -> dict[str, str]:
        return {
            self.ENV_PREFIX + f.name.upper(): str(getattr(self, f.name))
            for f in dataclasses.fields(self)
            if getattr(self, f.name) is not None
        }


def optional_sinks(config: ClickstreamConfig) -> list[Any]:
    """The PostgreSQL and Iceberg sinks, where the config names their tables."""
    sinks: list[Any] = []
    if config.postgres_table:
        key = ("user_id", "session_start")
        sinks.append(PostgresSink("sessions_pg", config.postgres_table, SESSION_SCHEMA, key=key))
    if config.iceberg_table:
        sinks.append(IcebergSink("sessions_iceberg", config.iceberg_table, SESSION_SCHEMA))
    return sinks


def clickstream_pipeline(config: ClickstreamConfig = ClickstreamConfig()) -> Pipeline:
    return Pipeline(
        name="clickstream",
        source=KafkaSource(topics=(config.topic,), starting="earliest"),
        enrich=Enrichment(
            functools.partial(make_profile_operator, config.profile_url),
            deadline_s=config.enrichment_deadline_s,
        ),
        key_by="user_id",
        process=Sessionize(),
        event_time=EventTime(
            field="ts",
            allowed_lateness_s=config.allowed_lateness_s,
            idle_timeout_s=config.idle_timeout_s,
        ),
        sinks=[
            ParquetSink("sessions", f"{config.root}/sessions", SESSION_SCHEMA),
            DeltaSink("sessions_delta", f"{config.root}/sessions_delta", SESSION_SCHEMA),
            KafkaSink("sessions_topic", config.sessions_topic, key_field="user_id"),
            *optional_sinks(config),
        ],
        dead_letters=DeadLetterSink(topic=config.dead_letter_topic, max_ratio=0.2),
        checkpoints=f"{config.root}/checkpoints",
        max_parallelism=config.max_parallelism,
        parallelism=config.parallelism,
    )


def reference_sessions(
    clicks: Iterable[dict[str, Any]], watermark: int | None, gap_ms: int = GAP_MS
) -> list[dict[str, Any]]:
    """Closed sessions computed in plain Python: what the pipeline must output, once each.

    ``clicks`` are the valid, non-late clicks with their ``segment``; a session is closed
    when ``watermark >= end + gap``."""
    from microbatch.examples.profile_service import profile_of

    per_user: dict[str, list[dict[str, Any]]] = {}
    for c in sorted(clicks, key=lambda c: (c["user_id"], c["ts"])):
        c = {**c, "segment": profile_of(c["user_id"])["segment"]}
        per_user[c["user_id"]] = merge_click(per_user.get(c["user_id"], []), c, gap_ms)
    out = []
    for user, sessions in per_user.items():
        for s in sessions:
            if watermark is not None and s["end"] + gap_ms <= watermark:
                out.append(session_row(user, s))
    return sorted(out, key=lambda r: (r["user_id"], r["session_start"]))
