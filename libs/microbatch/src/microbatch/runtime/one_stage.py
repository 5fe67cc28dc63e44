"""A dataflow without keyed steps runs in one Spark stage: no exchange.

Source → ``where``/``select``/``map``/``filter`` → sinks: no record has to meet another,
so none has to cross an exchange. The batch's ranges are dealt to the pipeline's
``parallelism`` operator instances (:func:`deal_ranges`), and each instance's task reads
its ranges, runs stage 1 and stages its sinks' output itself — as Spark's own file sink
writes in the task that reads. On Nexmark q0 (1M bids, two cores) the exchange moved
116 MB, and the stage after it took 2.9 of the batch's 8.6 s.

An instance sees only its own ranges, so its stage-1 totals are its share: the driver
adds them up and advances the watermark from the sum (:func:`with_batch_totals`), as
each instance of a two-stage batch does from the ``stat`` rows all of them receive.

It takes a reader that reads inside the tasks (the native reader, confluent-kafka or
kafka-python; Spark's JVM source gives a task per range) and no enrichment elements to
re-issue (they come in rows of their own). Every other batch runs its two stages (:mod:`.execute`).
"""

from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING

import pyarrow as pa
import pyarrow.compute as pc

from microbatch.errors import BatchError
from microbatch.gcpause import freeze_in_spark_worker
from microbatch.kafka.offsets import OffsetRange
from microbatch.kafka.reader import literal_rows
from microbatch.runtime.envelope import STAT, ticks
from microbatch.runtime.records import InstanceResult, StageOneTotals
from microbatch.runtime.stage_one import ReadingStageOne
from microbatch.runtime.stage_two import RESULT_DDL, StageTwo
from microbatch.runtime.steps import sink_only
from microbatch.runtime.windowed import exchange_schema

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

    from microbatch.runtime.pipeline import Pipeline

#: The readers that read inside stage 1's own tasks.
TASK_READERS = ("python", "confluent", "native")


def runs_in_one_stage(pipeline: Pipeline, reader: str, reissued: int) -> bool:
    """Can this batch run without an exchange? A dataflow without keyed steps, read in
    its tasks, with no enrichment elements to re-issue."""
    return sink_only(pipeline) and reader in TASK_READERS and not reissued


def deal_ranges(ranges: Iterable[OffsetRange], parallelism: int) -> list[list[OffsetRange]]:
    """The ranges of each instance: the largest range first, each to the instance with
    the fewest records so far (the lowest-numbered on a tie), so the same plan always
    deals the same way. An instance may get none. Each instance's ranges are in source
    order, so its rows are read in the order its sinks write them."""
    dealt: list[list[OffsetRange]] = [[] for _ in range(parallelism)]
    load = [(0, i) for i in range(parallelism)]
    for r in sorted((r for r in ranges if r.count), key=lambda r: (-r.count, r)):
        records, i = heapq.heappop(load)
        dealt[i].append(r)
        heapq.heappush(load, (records + r.count, i))
    return [sorted(own) for own in dealt]


def instance_descriptors(
    spark: SparkSession, ranges: Iterable[OffsetRange], parallelism: int
) -> DataFrame:
    """Rows ``(instance, topic, partition, start, end)``, one Spark partition per instance
    holding its dealt ranges, and a row with a null topic where it has none (so every
    instance runs): ``parallelism × m`` rows in ``parallelism`` slices put rows
    ``[k·m, (k+1)·m)`` in slice ``k`` (:func:`~microbatch.kafka.reader.literal_rows`)."""
    from pyspark.sql import functions as F

    dealt = deal_ranges(ranges, parallelism)
    m = max(1, *(len(d) for d in dealt))
    rows = []
    for instance, own in enumerate(dealt):
        for j in range(m):
            r = own[j] if j < len(own) else None
            rows.append(
                F.struct(
                    F.lit(instance).cast("int").alias("instance"),
                    F.lit(r and r.topic).cast("string").alias("topic"),
                    F.lit(r and r.partition).cast("int").alias("partition"),
                    F.lit(r and r.start).cast("bigint").alias("start"),
                    F.lit(r and r.end).cast("bigint").alias("end"),
                )
            )
    return literal_rows(spark, rows, parallelism)


def one_stage(
    reading: ReadingStageOne, stage: StageTwo
) -> Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]]:
    """The ``mapInArrow`` body over one instance's descriptors: read its ranges, stage 1,
    then stage 2 of that instance, in one task; its result row as stage 2's."""
    pipeline = stage.pipeline

    def per_instance(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        freeze_in_spark_worker()
        descriptors = pa.Table.from_batches(list(batches))
        instances = pc.unique(descriptors.column("instance")).to_pylist()
        if len(instances) != 1:
            raise BatchError(
                f"pipeline {pipeline.name!r} batch {stage.batch_id}: a one-stage task holds "
                f"instances {sorted(instances)}, expected exactly one"
            )
        instance = instances[0]
        ranges = descriptors.filter(pc.is_valid(descriptors.column("topic")))
        rows = [ticks([instance], exchange_schema(pipeline))]
        if ranges.num_rows:
            read = reading.read(ranges.drop_columns(["instance"]).to_batches())
            batches_out = list(reading.stage.envelope_batches(read))
            rows += [pa.Table.from_batches([b]) for b in batches_out]
        table = pa.concat_tables(rows, promote_options="permissive")
        # Stage 1 sends a batch's ``stat`` rows to every instance; here there is only one.
        other = pc.not_equal(table.column("kind"), STAT)
        table = table.filter(pc.or_(other, pc.equal(table.column("instance"), instance)))
        yield from stage((instance,), table).to_batches()

    return per_instance


def one_stage_frame(
    spark: SparkSession, ranges: Sequence[OffsetRange], reading: ReadingStageOne, stage: StageTwo
) -> DataFrame:
    """The batch as one Spark stage: its collected rows are the instances' results
    (``RESULT_DDL``)."""
    descriptors = instance_descriptors(spark, ranges, stage.parallelism)
    return descriptors.mapInArrow(one_stage(reading, stage), RESULT_DDL)


def with_batch_totals(
    results: Sequence[InstanceResult], stage: StageTwo
) -> tuple[InstanceResult, ...]:
    """Each instance's result with the batch's stage-1 totals (the sum of every
    instance's share) and the event-time state they advance the batch to."""
    totals = StageOneTotals.sum_of(r.stage_one for r in results)
    event_time = stage.event_time_after(totals)
    return tuple(dataclasses.replace(r, stage_one=totals, event_time=event_time) for r in results)
