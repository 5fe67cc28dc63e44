"""What a caller chooses for one run (:class:`BatchOptions`) and what it gets back
(:class:`BatchResult`: the CLI's, XCom's and the UI's view of a batch)."""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import Mapping
from typing import Any

from microbatch.checkpoint import Layout
from microbatch.errors import MicrobatchError
from microbatch.runtime.records import BatchRecord, BatchStats
from microbatch.storage import ObjectStore

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class BatchOptions:
    """Per-run choices; None means "the pipeline's default".

    ``interval_start_ms``/``until_timestamp_ms`` are the run's data interval (recorded in
    the checkpoint). With ``backfill``, a pipeline that already went past the interval's
    start first rewinds to the checkpoint that ended there (:mod:`.rewind`), so the
    interval is processed again from the state it had then; ``accept_kafka_repeats``
    allows that for pipelines with Kafka sinks (their records are published again).
    """

    until_timestamp_ms: int | None = None
    interval_start_ms: int | None = None
    backfill: bool = False
    accept_kafka_repeats: bool = False
    parallelism: int | None = None
    max_records_per_batch: int | None = None
    dry_run: bool = False
    run_id: str | None = None
    crash_at: str | None = None
    #: Plan the batch again if Kafka deleted records its stored plan was to read (see
    #: :mod:`.planning`); the lost offsets are recorded as skipped.
    replan: bool = False


@dataclasses.dataclass
class BatchResult:
    """What a batch did; ``to_json()`` is what the CLI, XCom and the UI show."""

    pipeline: str
    batch_id: int
    parallelism: int
    status: str  # "committed" | "dry_run"
    replayed: bool = False
    records_in: int = 0
    dead_letters: int = 0
    dead_letter_reasons: dict[str, int] = dataclasses.field(default_factory=dict)
    outputs: dict[str, int] = dataclasses.field(default_factory=dict)
    watermark: int | None = None
    lag: dict[str, int] = dataclasses.field(default_factory=dict)
    ranges: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    recovered_publish: int | None = None
    rewind: dict[str, Any] | None = None
    state_bytes_written: int = 0
    seconds: dict[str, float] = dataclasses.field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def committed(self, record: BatchRecord, snapshots: list[Any], dead_letters: Any) -> None:
        """Fill in what the committed batch ``record`` did (``dead_letters``: the
        pipeline's dead-letter sink, whose count is not an output)."""
        stats = record.stats or BatchStats()
        self.status = "committed"
        self.records_in = stats.records_in
        self.dead_letters = stats.dead_letters
        self.dead_letter_reasons = dict(stats.dead_letter_reasons)
        self.outputs = {
            name: n
            for name, n in stats.outputs.items()
            if dead_letters is None or name != dead_letters.name
        }
        self.watermark = record.watermark
        self.state_bytes_written = sum(s.bytes_written for s in snapshots)


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """How the first attempt of a batch runs it (the layout's ``batches/<id>``): a rerun
    replays the plan at the same parallelism, so it writes the same files."""

    batch_id: int
    parallelism: int
    run_id: str | None = None

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, body: Mapping[str, Any]) -> RunSpec:
        return cls(body["batch_id"], body["parallelism"], body.get("run_id"))


class Laps:
    """Seconds per phase, for the result and the batch's stats."""

    def __init__(self) -> None:
        self.start = self.last = time.perf_counter()
        self.seconds: dict[str, float] = {}

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.seconds[name] = round(now - self.last, 3)
        self.last = now

    def since_start(self) -> float:
        return round(time.perf_counter() - self.start, 3)


def record_run_spec(store: ObjectStore, layout: Layout, pipeline: str, spec: RunSpec) -> RunSpec:
    """Record ``spec`` as the batch's run spec, unless an earlier attempt recorded one:
    then that one wins (a rerun replays the plan at the parallelism it was planned for)."""
    key = layout.spec_key(spec.batch_id)
    try:
        store.create(key, json.dumps(spec.to_json()).encode())
        return spec
    except MicrobatchError:
        stored = RunSpec.from_json(json.loads(store.get(key)))
    if stored.parallelism != spec.parallelism:
        log.warning(
            "pipeline %s: batch %s replays its recorded plan at parallelism %s; "
            "parallelism %s applies from the next batch",
            pipeline,
            spec.batch_id,
            stored.parallelism,
            spec.parallelism,
        )
    return stored
