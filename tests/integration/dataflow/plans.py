"""What Spark ran for one dataflow batch: its plan, exchanges and jobs."""

from __future__ import annotations

from typing import Any

from microbatch.runtime import BatchOptions, BatchRunner, Pipeline


def one_batch_plan(spark: Any, pipe: Pipeline, settings: Any, group: str) -> tuple[str, int, int]:
    """Run one batch of ``pipe`` in Spark job group ``group``: the plan that ran (adaptive
    execution's final plan), its number of exchanges, and the Spark jobs of the batch."""
    runner = BatchRunner(spark, pipe, settings)
    spark.sparkContext.setJobGroup(group, "one dataflow batch")
    try:
        runner.run(BatchOptions(run_id="plan"))
    finally:
        spark.sparkContext.setJobGroup("", "")
    plan = runner.executor.last_frame._jdf.queryExecution().executedPlan().toString()
    final = plan.split("== Initial Plan ==")[0]
    exchanges = sum(1 for line in final.splitlines() if "+- Exchange" in line)
    jobs = len(spark.sparkContext.statusTracker().getJobIdsForGroup(group))
    return plan, exchanges, jobs
