"""The batch task's arguments: the data interval is the batch, params fill the rest."""

from __future__ import annotations

import datetime as dt
from types import SimpleNamespace

from microbatch_airflow.operators import MicrobatchBatchOperator, interval_end

END = dt.datetime(2026, 1, 1, 0, 5, tzinfo=dt.UTC)


def test_until_is_the_data_interval_end_else_the_logical_date_else_the_trigger_time():
    later = END + dt.timedelta(minutes=1)

    assert interval_end({"data_interval_end": END, "logical_date": later}) == END.isoformat()
    assert interval_end({"data_interval_end": None, "logical_date": later}) == later.isoformat()
    run = SimpleNamespace(run_after=later)
    assert interval_end({"logical_date": None, "dag_run": run}) == later.isoformat()


def test_params_fill_what_the_operator_leaves_open():
    op = MicrobatchBatchOperator(task_id="batch", job="jobs/clickstream.py", max_records=10,
                                 run_id="clickstream/manual__1")  # fmt: skip
    context = {
        "data_interval_end": END,
        "params": {"parallelism": 4, "max_records": None, "dry_run": True},
    }

    args, dry_run = op.batch_args(context)

    assert dry_run is True
    assert args == ["--until", END.isoformat(), "--run-id", "clickstream/manual__1",
                    "--parallelism", "4", "--max-records", "10", "--dry-run"]  # fmt: skip


def test_default_run_id_is_templated_per_dag_run():
    op = MicrobatchBatchOperator(task_id="batch", job="jobs/clickstream.py")

    assert op.run_id == "{{ dag.dag_id }}/{{ run_id }}"
    assert "run_id" in op.template_fields and "until" in op.template_fields
