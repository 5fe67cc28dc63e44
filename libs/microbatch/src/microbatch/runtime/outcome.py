"""What a batch's commit records, from what its instances returned: the agreed stage-1
totals and event time, the staged output per sink, the stats, the dead-letter check."""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

from microbatch.errors import BatchError
from microbatch.kafka import BatchPlan, snapshot_to_json
from microbatch.runtime.execute import Execution
from microbatch.runtime.pipeline import Pipeline
from microbatch.runtime.records import (
    BatchRecord,
    BatchStats,
    InstanceResult,
    InstanceStats,
    StageOneTotals,
)
from microbatch.runtime.watermark import WatermarkState
from microbatch.sinks.base import Staged


def agreed_stage_one(
    where: str, results: Sequence[InstanceResult]
) -> tuple[StageOneTotals, WatermarkState]:
    """Stage 1's totals and the batch's event-time state, which every instance computed
    from the same ``stat`` rows. They differ only if Spark re-ran a stage-1 task whose
    output was not the same (enrichment deadlines) after some instances had read it: then
    this attempt commits nothing."""
    totals = [(r.stage_one, r.event_time) for r in results]
    if any(t != totals[0] for t in totals[1:]):
        raise BatchError(
            f"{where}: the operator instances saw different stage-1 results (a stage-1 "
            "task ran twice with different output); nothing was committed, run the batch "
            "again"
        )
    return totals[0]


def staged_by_sink(pipeline: Pipeline, results: Sequence[InstanceResult]) -> dict[str, Any]:
    return {s.name: tuple(r.staged.get(s.name) for r in results) for s in pipeline.all_sinks()}


def batch_stats(
    plan: BatchPlan,
    execution: Execution,
    totals: StageOneTotals,
    pending_in: Any,
    sinks: Mapping[str, Sequence[Staged | None]],
) -> BatchStats:
    """What the batch counted; ``sinks``: what each sink staged (:func:`staged_by_sink`)."""
    reasons: Counter[str] = Counter()
    for r in execution.results:
        for k, v in r.counters.items():
            if k.startswith("dead_letters."):
                reasons[k.split(".", 1)[1]] += v
    outputs = {name: sum(s.rows for s in staged if s) for name, staged in sinks.items()}
    return BatchStats(
        records_in=totals.inputs,
        dead_letters=sum(r.counters.get("dead_letters", 0) for r in execution.results),
        dead_letter_reasons=dict(reasons),
        outputs=outputs,
        enrich_pending=totals.pending,
        enrich_reissued=0 if pending_in is None else pending_in.num_rows,
        per_partition=totals.per_partition,
        skipped=snapshot_to_json(plan.skipped),
        reader=execution.reader,
        instances=tuple(
            InstanceStats(r.instance, r.counters, r.seconds) for r in execution.results
        ),
    )


def with_seconds(record: BatchRecord, seconds: dict[str, float]) -> BatchRecord:
    stats = dataclasses.replace(record.stats or BatchStats(), seconds=seconds)
    return dataclasses.replace(record, stats=stats)


def check_dead_letters(pipeline: Pipeline, where: str, record: BatchRecord) -> None:
    """Fail the batch, before anything commits, above the dead-letter ``max_ratio``."""
    dl, stats = pipeline.dead_letters, record.stats
    if dl is None or dl.max_ratio is None or stats is None or not stats.records_in:
        return
    ratio = stats.dead_letters / stats.records_in
    if ratio > dl.max_ratio:
        raise BatchError(
            f"{where}: {stats.dead_letters} of {stats.records_in} records ({ratio:.1%}) "
            f"went to the dead letters, above max_ratio {dl.max_ratio:.1%}; reasons: "
            f"{dict(stats.dead_letter_reasons)}. Nothing was committed: fix the input or "
            "the pipeline, or raise max_ratio."
        )
