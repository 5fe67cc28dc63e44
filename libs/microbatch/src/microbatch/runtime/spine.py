"""A dataflow's keyed steps in one Spark job: one exchange per level of keyed steps.

Stage 1 (the same as a single-operator pipeline's) keys records for the first step; then
for each keyed step, ``repartitionById`` puts each instance's rows in one partition and a
``mapInArrow`` runs the step (:meth:`StageTwo.run_step`). Its output rows are the next
step's input — records keyed for it, the dead letters so far (the last step stages them),
a copy of the ``stat`` rows and a ``tick`` per next instance (from instance 0), so every
next instance computes the same watermark and runs even without input — plus one
``result`` row per instance, which later steps pass through to the driver. Steps that
read nothing of each other and run one after the other (a source's branches) share a
level: one exchange, and one task per instance that runs each of them in turn
(:func:`level_instance`), so no step's records ride through a sibling's exchange. So
does a step that reads a window on the window's own key (:func:`keeps_key`): its
records from the window are on the window's instance already, handed over in the task.
Nothing is materialised between the steps: each exchange is the only copy. (Packing an
instance's records into a few Arrow IPC rows per exchange was measured and dropped: the
dataflow bench spent 0.4 CPU-s more per 300k records packing and unpacking than the JVM
saved.)
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from microbatch.errors import BatchError
from microbatch.gcpause import freeze_in_spark_worker, gc_paused
from microbatch.runtime.envelope import (
    DEAD_LETTER,
    ENVELOPE_SCHEMA,
    PARTIAL,
    RECORD,
    RESULT,
    STAT,
    TICK,
    ticks,
)
from microbatch.runtime.graph import Edge, edges_into, first_uid
from microbatch.runtime.packed import packed, unpacked
from microbatch.runtime.process import KeyedProcessFunction
from microbatch.runtime.records import InstanceResult
from microbatch.runtime.router import Router
from microbatch.runtime.stage_two import StageTwo
from microbatch.runtime.steps import FOR
from microbatch.runtime.wire import Tags, tags_of

Body = Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]]


def step_stages(stage: StageTwo) -> list[StageTwo]:
    """The stage of every keyed step, first to last."""
    return [stage, *(stage.for_step(s.uid) for s in stage.pipeline.steps)]


def spine_frame(rows: Any, stage: StageTwo) -> Any:
    """Every keyed step over ``rows`` (stage 1's envelope rows and ticks, a DataFrame):
    the DataFrame of all steps' ``result`` rows, not yet computed."""
    from pyspark.sql.pandas.types import from_arrow_schema

    plain = from_arrow_schema(tags_of(stage.pipeline).wire_schema(ENVELOPE_SCHEMA))
    for level in step_levels(stage):
        body = step_instance(level[0]) if len(level) == 1 else level_instance(level)
        rows = rows.repartitionById(stage.parallelism, "instance").mapInArrow(body, plain)
    return rows


def step_levels(stage: StageTwo) -> list[list[StageTwo]]:
    """The stages of the keyed steps, first to last, in levels: a step joins the level
    before it unless it reads a step of that level other than on that step's own key
    (:func:`keeps_key`). So one exchange brings each instance of all of a level's steps
    their rows, and a step reading a step of its level finds that step's records for it
    on the same instance, handed over in the task (:func:`level_instance`)."""
    pipeline = stage.pipeline
    first = first_uid(pipeline)
    levels: list[list[StageTwo]] = []
    for step in step_stages(stage):
        uid = step.step or first
        if levels:
            level = {s.step or first: s for s in levels[-1]}
            into = [(e, level.get(e.origin)) if isinstance(e.origin, str) else (e, None)
                    for e in edges_into(pipeline, uid)]  # fmt: skip
            if all(origin is None or keeps_key(e, origin.process_fn) for e, origin in into):
                levels[-1].append(step)
                continue
        levels.append([step])
    return levels


def keeps_key(edge: Edge, origin: KeyedProcessFunction) -> bool:
    """Is ``edge`` keyed by the key of the step it leaves, so that each of its records
    stays on the instance that made it? So for a window's output keyed by ``"key"`` (its
    own key, unless an aggregate is named so), with no record-wise step between: Nexmark
    q8's count per seller into its join on the seller, an aggregate into a second one."""
    if edge.chain or edge.key_by != "key" or not getattr(origin, "columnar", False):
        return False
    operator = getattr(origin, "operator", None)
    return operator is not None and all(a.name != "key" for a in operator.aggregates)


def step_instance(stage: StageTwo) -> Body:
    """The mapInArrow body of one keyed step over one partition: one whole instance;
    its rows in and out as they cross the exchanges (:mod:`.wire`)."""
    tags = tags_of(stage.pipeline)
    later_topics = topics_for_later(stage.step, tags)

    def _rows_of_instance(full: pa.Table) -> Iterator[pa.Table]:
        table = full.select(ENVELOPE_SCHEMA.names)
        earlier = pc.equal(table.column("kind"), tags.kind_code(RESULT))
        later = rows_for_later(table, later_topics, tags)  # ride on through this step
        if later is not None:
            earlier = pc.or_(earlier, later)
        own = tags.from_wire(full.filter(pc.invert(earlier)))
        instance = _only_instance(own, stage)
        with gc_paused():  # as a single-operator pipeline's stage 2 (StageTwo.__call__)
            result, router = stage.run_step(instance, own)
            forward = None if stage.is_last else _onward(router, tags)
            del router  # its rows freed while paused (see microbatch.gcpause)
        yield table.filter(earlier)
        yield pa.Table.from_batches([result_row(stage.step or "", result)])
        if forward is None:
            return
        yield forward
        if instance == 0:
            yield from _for_every_next_instance(table, stage, tags)

    return _wire_body(_rows_of_instance, stage, tags)


def _wire_body(rows_of: Callable[[pa.Table], Iterator[pa.Table]], stage: StageTwo, tags: Tags
               ) -> Body:  # fmt: skip
    """The mapInArrow body around ``rows_of``: a partition's rows in, as they crossed
    the exchange (wire codes, checked), and ``rows_of``' tables out, on the wire again.

    The first step's rows may carry the value columns stage 1 decoded (a declared
    schema): the step reads them; what it hands on is the envelope alone. Rows that only
    pass through (results, records for later steps) stay as they came."""
    wire_envelope = tags.wire_schema(ENVELOPE_SCHEMA)

    def per_instance(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        freeze_in_spark_worker()
        received = list(batches)
        full = (
            pa.Table.from_batches(received)
            if received
            else pa.Table.from_batches([], schema=wire_envelope)
        )
        if not pa.types.is_integer(full.schema.field("kind").type):
            raise BatchError(
                f"pipeline {stage.pipeline.name!r} batch {stage.batch_id}: a keyed step's "
                "rows must arrive on the wire codes (Tags.to_wire), as they cross Spark"
            )
        full = unpacked(full, tags, f"pipeline {stage.pipeline.name!r} batch {stage.batch_id}")
        for rows in rows_of(full):
            yield from tags.to_wire(rows).to_batches()

    return per_instance


def _onward(router: Router, tags: Tags) -> pa.Table:
    """What a step hands the next exchange: its records packed, its dead letters so far
    as rows (few; the last step stages them)."""
    records = packed(router.record_rows(), tags)
    return pa.Table.from_batches([records, router.dead_letter_rows()])


def _only_instance(own: pa.Table, stage: StageTwo) -> int:
    """The one instance whose rows ``own`` holds (every partition holds its tick)."""
    instances = pc.unique(own.column("instance")).to_pylist()
    if len(instances) != 1:
        step = "the first keyed step" if stage.step is None else f"step {stage.step!r}"
        raise BatchError(
            f"pipeline {stage.pipeline.name!r} batch {stage.batch_id} {step}: a "
            f"partition holds instances {sorted(instances)}, expected exactly one"
        )
    return int(instances[0])


def _for_every_next_instance(table: pa.Table, stage: StageTwo, tags: Tags) -> Iterator[pa.Table]:
    """From instance 0: a copy of the ``stat`` rows and a tick for each instance of the
    next exchange, so each computes the batch's watermark and runs even without input."""
    stats = table.filter(pc.equal(table.column("kind"), tags.kind_code(STAT)))
    for j in range(stage.parallelism):
        yield stats.set_column(
            stats.schema.get_field_index("instance"),
            "instance",
            pa.array([j] * stats.num_rows, pa.int32()),
        )
    yield ticks(range(stage.parallelism))


def level_instance(level: list[StageTwo]) -> Body:
    """The mapInArrow body of a level of keyed steps over one partition: one instance of
    each, run in order, as if each had its own exchange. Each step takes its own records,
    the ``stat`` rows and the tick. The first also takes what only a first step reads
    (pending elements, records for sinks fed before it); a step reading an earlier step
    of the level on its key takes that step's records for it (:func:`_hand_over`); the
    last takes the dead letters so far and those the steps before it in the level made,
    and hands on (or, as the pipeline's last step, stages) all of them."""
    pipeline = level[0].pipeline
    tags = tags_of(pipeline)
    uids = [stage.step for stage in level]
    later_topics = topics_for_later_than(uids, tags)
    own_topics = [_topics_of(uid, tags) for uid in uids]
    last = len(level) - 1

    def _rows_of_level(full: pa.Table) -> Iterator[pa.Table]:
        table = full.select(ENVELOPE_SCHEMA.names)
        kind, topic = table.column("kind"), table.column("topic")
        # a step's own rows, by topic: its records, and the partials stage 1 reduced its
        # records to (a window fed by sources, runtime.graph_partials)
        record = pc.or_(
            pc.equal(kind, tags.kind_code(RECORD)), pc.equal(kind, tags.kind_code(PARTIAL))
        )
        riding = pc.equal(kind, tags.kind_code(RESULT))
        later = rows_for_later(table, later_topics, tags)
        if later is not None:
            riding = pc.or_(riding, later)
        shared = pc.or_(pc.equal(kind, tags.kind_code(STAT)), pc.equal(kind, tags.kind_code(TICK)))
        dead = pc.equal(kind, tags.kind_code(DEAD_LETTER))
        others = pc.invert(pc.or_(riding, record))  # stat, tick, dead letters, pending...
        takes = [pc.and_(others, pc.invert(dead)), *[shared] * (last - 1), pc.or_(shared, dead)]
        handed: list[pa.Table] = []  # dead letters of the level's steps before the last
        chained: dict[int, list[pa.Table]] = {}  # records for step j from a step before it
        out: list[pa.Table] = [table.filter(riding)]
        instance = 0
        for i, stage in enumerate(level):
            mine = pc.fill_null(pc.and_(record, pc.is_in(topic, value_set=own_topics[i])), False)
            own = tags.from_wire(full.filter(pc.or_(mine, takes[i])))
            more = chained.pop(i, []) + (handed if i == last else [])
            if more:
                own = pa.concat_tables([own, *more], promote_options="default")
            instance = _only_instance(own, stage)
            with gc_paused():
                result, router = stage.run_step(instance, own)
                if i < last:
                    handed.append(pa.Table.from_batches([router.dead_letter_rows()]))
                    records = pa.Table.from_batches([router.record_rows()])
                    rest = _hand_over(records, level, i, instance, chained)
                    forward = pa.Table.from_batches([packed(rest, tags)])
                else:
                    forward = None if stage.is_last else _onward(router, tags)
                del router  # its rows freed while paused (see microbatch.gcpause)
            out.append(pa.Table.from_batches([result_row(stage.step or "", result)]))
            if forward is not None:
                out.append(forward)
        yield from out
        if not level[last].is_last and instance == 0:
            yield from _for_every_next_instance(table, level[last], tags)

    return _wire_body(_rows_of_level, level[0], tags)


def _hand_over(records: pa.Table, level: list[StageTwo], i: int, instance: int,
               chained: dict[int, list[pa.Table]]) -> pa.Table:  # fmt: skip
    """Of the records step ``i`` of ``level`` hands on: those for a later step of the
    level into ``chained`` (it reads them on its key, so they are this instance's);
    the rest returned, for later levels."""
    rest = records
    for j in range(i + 1, len(level)):
        to_j = pc.ends_with(rest.column("topic"), pattern=f"{FOR}{level[j].step}")
        if not pc.any(to_j).as_py():
            continue
        theirs = rest.filter(to_j)
        elsewhere = pc.not_equal(theirs.column("instance"), instance)
        if pc.any(elsewhere).as_py():
            stage = level[j]
            raise BatchError(
                f"pipeline {stage.pipeline.name!r} batch {stage.batch_id} step {stage.step!r}: "
                f"records keyed by 'key' from step {level[i].step or stage.pipeline.uid!r} "
                f"went to instance {pc.min(theirs.filter(elsewhere)['instance']).as_py()}, not "
                f"{instance}: the step's key changed its encoding on the way. Key the step "
                "by a function instead (key_by(lambda r: r['key'])), which gives it an "
                "exchange of its own, and report this as a bug."
            )
        chained.setdefault(j, []).append(theirs)
        rest = rest.filter(pc.invert(to_j))
    return rest


def _topics_of(uid: str | None, tags: Tags) -> pa.Array:
    """The wire codes of the topics of records for step ``uid`` (None: the first step,
    whose records keep their source topic)."""
    if uid is None:
        return tags.topic_codes(lambda topic: FOR not in topic)
    own = f"{FOR}{uid}"
    return tags.topic_codes(lambda topic: topic.endswith(own))


def topics_for_later(step: str | None, tags: Tags) -> pa.Array:
    """The wire codes of the markers of records for a keyed step after ``step`` (None:
    the first step); empty in a chain, where every record row is the step's own."""
    return topics_for_later_than([step], tags)


def topics_for_later_than(level: Sequence[str | None], tags: Tags) -> pa.Array:
    """The wire codes of the markers of records for a keyed step after the steps of
    ``level`` (None: the first step, whose records carry no marker)."""
    own = tuple(f"{FOR}{uid}" for uid in level if uid is not None)
    return tags.topic_codes(lambda topic: FOR in topic and not topic.endswith(own))


def rows_for_later(table: pa.Table, codes: pa.Array, tags: Tags) -> pa.ChunkedArray | None:
    """Which of ``table``'s wire rows are records whose topic is one of ``codes``
    (:func:`topics_for_later`), or None when there are no such topics."""
    if not len(codes):
        return None
    records = pc.equal(table.column("kind"), tags.kind_code(RECORD))
    later = pc.and_(records, pc.is_in(table.column("topic"), value_set=codes))
    return pc.fill_null(later, False)  # a dead letter without a topic is no record


def result_row(uid: str, result: InstanceResult) -> pa.RecordBatch:
    cols: dict[str, list[Any]] = {f.name: [None] for f in ENVELOPE_SCHEMA}
    cols |= {"kind": [RESULT], "topic": [uid], "instance": [result.instance]}
    cols["payload"] = [json.dumps(result.to_json()).encode()]
    return pa.RecordBatch.from_pydict(cols, schema=ENVELOPE_SCHEMA)


def step_results(
    rows: list[Any], stage: StageTwo
) -> tuple[tuple[InstanceResult, ...], dict[str, tuple[InstanceResult, ...]]]:
    """The collected ``result`` rows as the first step's results and each further step's,
    in instance order; refused unless every step reported every instance once."""
    by_step: dict[str, list[InstanceResult]] = {}
    tags = tags_of(stage.pipeline)
    for r in rows:
        body = json.loads(bytes(r["payload"]))
        by_step.setdefault(tags.topic_of(r["topic"]), []).append(InstanceResult.from_json(body))
    expected = list(range(stage.parallelism))
    out: dict[str, tuple[InstanceResult, ...]] = {}
    for step in step_stages(stage):
        uid = step.step or ""
        results = sorted(by_step.pop(uid, []), key=lambda r: r.instance)
        got = [r.instance for r in results]
        if got != expected:
            raise BatchError(
                f"pipeline {stage.pipeline.name!r} batch {stage.batch_id} step {uid!r}: "
                f"instances {got} reported, expected {expected}"
            )
        out[uid] = tuple(results)
    first = out.pop("")
    return first, out
