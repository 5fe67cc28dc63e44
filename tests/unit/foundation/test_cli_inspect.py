"""The CLI's output, without services: one time format in every ``--json``, the run's
progress lines, ``state`` of a key that has none, and ``status`` after a killed run.

Batches run through the real ``microbatch`` command (``main``) with the commit protocol's
stand-ins for Kafka and Spark (``tests/unit/runtime/test_protocol.py``); checkpoints live
on the local filesystem."""

from __future__ import annotations

import json
from contextlib import nullcontext
from pathlib import Path
from types import SimpleNamespace

import pytest

import microbatch.cli_inspect
import microbatch.runtime
from microbatch.cli import main
from microbatch.cli_inspect import iso, iso_to_ms, pipeline_status, print_status, with_iso
from microbatch.errors import ExitCode
from microbatch.jobfile import load_pipeline
from microbatch.kafka import KafkaBrokerView
from microbatch.keygroups import key_group, operator_index
from microbatch.runtime import BatchRunner
from microbatch.storage import open_store
from tests.unit.runtime.test_protocol import InProcess, Log

JOB = """
from microbatch.runtime import EventTime, KafkaSource, KeyedProcessFunction, ParquetSink, Pipeline


class CountAndRemind(KeyedProcessFunction):
    def process(self, key, records, ctx):
        total = ctx.value("total")
        total.set(total.get(0) + len(records))
        ctx.register_timer(1_795_686_720_000 + max(r["n"] for r in records))
        ctx.emit({{"user": key, "total": total.get()}})


pipeline = Pipeline(
    name="counts",
    source=KafkaSource(topics=("clicks",)),
    key_by="user",
    process=CountAndRemind(),
    event_time=EventTime(field="n", watermark="global_max"),
    sinks=[ParquetSink("totals", {totals!r})],
    checkpoints={checkpoints!r},
    max_parallelism=8,
    parallelism=2,
)
"""


@pytest.fixture
def stack(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> SimpleNamespace:
    """A job file whose batches run in this process against a stand-in broker."""
    log = Log(partitions=2)
    log.produce(0, "ann", "bob", "ann")
    log.produce(1, "cid", "ann")

    class StandIn(BatchRunner):
        def __init__(self, spark, pipeline, settings) -> None:
            super().__init__(spark, pipeline, settings, executor=InProcess(log), broker=log)

    monkeypatch.setattr(microbatch.runtime, "BatchRunner", StandIn)
    monkeypatch.setattr(
        KafkaBrokerView, "for_settings", classmethod(lambda cls, *a, **kw: nullcontext(log))
    )
    monkeypatch.setenv("MICROBATCH_SPARK_MASTER", "local[1]")
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT", raising=False)
    checkpoints = str(tmp_path / "checkpoints")
    job = tmp_path / "job.py"
    job.write_text(JOB.format(totals=str(tmp_path / "totals"), checkpoints=checkpoints))
    return SimpleNamespace(job=str(job), log=log, store=open_store(checkpoints))


def cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


# One time format ------------------------------------------------------------------------
def test_a_time_is_epoch_ms_with_an_exact_iso_companion_right_after_it():
    body = with_iso({"a": 1, "watermark": 1_795_686_720_123, "timers": [0, 5], "z": None},
                    "watermark", "timers", "z")  # fmt: skip

    assert list(body) == ["a", "watermark", "watermark_iso", "timers", "timers_iso", "z", "z_iso"]
    assert body["watermark_iso"] == "2026-11-26T09:52:00.123+00:00"
    assert body["timers_iso"] == ["1970-01-01T00:00:00.000+00:00", "1970-01-01T00:00:00.005+00:00"]
    assert body["z_iso"] is None
    assert iso_to_ms(iso(1_795_686_720_123)) == 1_795_686_720_123
    assert iso_to_ms("2026-11-26T09:52:00.123Z") == 1_795_686_720_123
    assert iso_to_ms("") is None and iso_to_ms("yesterday") is None


def test_every_json_output_gives_times_as_epoch_ms_and_iso(stack, capsys):
    code, out, _ = cli(capsys, "run", stack.job, "--json")
    assert code == 0
    (batch,) = json.loads(out)["batches"]  # event time is the stand-in's "n": 0, 2, 4, ...
    assert batch["watermark"] == 4 and batch["watermark_iso"] == "1970-01-01T00:00:00.004+00:00"

    code, out, _ = cli(capsys, "checkpoints", stack.job, "--json")
    assert code == 0
    (row,) = json.loads(out)["checkpoints"]
    assert isinstance(row["created_at"], int) and row["created_at_iso"] == iso(row["created_at"])
    assert (row["watermark"], row["watermark_iso"]) == (4, "1970-01-01T00:00:00.004+00:00")

    code, out, _ = cli(capsys, "status", stack.job, "--json")
    assert code == 0
    status = json.loads(out)
    assert status["created_at"] == row["created_at"]
    assert status["created_at_iso"] == row["created_at_iso"]
    assert status["watermark_iso"] == "1970-01-01T00:00:00.004+00:00"
    lease = status["lease"]  # released by the run
    assert lease["expires_at_iso"] == iso(lease["expires_at"])
    assert lease["acquired_at_iso"] == iso(lease["acquired_at"])

    code, out, _ = cli(capsys, "state", stack.job, "ann", "--json")
    assert code == 0
    state = json.loads(out)
    assert state["state"] == {"total": 3}
    assert state["timers"] == [1_795_686_720_004]
    assert state["timers_iso"] == ["2026-11-26T09:52:00.004+00:00"]


def test_the_readable_outputs_show_times_as_iso(stack, capsys):
    assert cli(capsys, "run", stack.job)[0] == 0

    _, listing, _ = cli(capsys, "checkpoints", stack.job)
    header, _rule, row = listing.splitlines()
    assert header.split() == ["checkpoint", "created_at", "parallelism", "records_in",
                              "dead_letters", "watermark", "state_bytes", "full"]  # fmt: skip
    assert row.split()[5] == "1970-01-01T00:00:00+00:00"
    assert row.split()[1].endswith("+00:00") and "." not in row.split()[1]  # to the second

    _, shown, _ = cli(capsys, "state", stack.job, "ann")
    assert shown.splitlines() == [
        f"pipeline counts: key 'ann' at checkpoint 0 (key-group {key_group('ann', 8)})",
        "  total: 3",
        "  timers: 2026-11-26T09:52:00+00:00",
    ]


# The run's progress lines ----------------------------------------------------------------
def test_the_loop_count_is_worded_apart_from_the_batch_id(stack, capsys):
    stack.log.produce(1, "dan")  # nothing more after it: the second batch reads nothing

    code, _, err = cli(capsys, "run", stack.job, "--batches", "2")

    assert code == 0
    lines = [line for line in err.splitlines() if not line.startswith("MICROBATCH_RESULT")]
    assert lines[0] == "run 1 of 2: planning the next batch ..."
    assert lines[1].startswith("batch 0 committed in ")
    assert lines[2] == "run 2 of 2: planning the next batch ..."
    assert lines[3].startswith("batch 1 committed in ")
    assert not any("batch 1/2" in line for line in lines)


# state of a key without state ------------------------------------------------------------
def test_state_of_a_key_without_state_names_where_it_looked_and_exits_not_found(stack, capsys):
    assert cli(capsys, "run", stack.job)[0] == 0

    code, out, err = cli(capsys, "state", stack.job, "nobody")

    kg = key_group("nobody", 8)
    assert code == ExitCode.NOT_FOUND == 6
    assert out == ""
    assert err.strip() == (
        "microbatch state: pipeline 'counts': key 'nobody' has no state and no timers in any "
        f"operator at checkpoint 0 ({stack.store.url}); it would be in key-group {kg} of 8 "
        f"(instance {operator_index(kg, 8, 2)} of 2). Check the key's spelling and type, or "
        "look at an older checkpoint with --checkpoint"
    )


def test_state_of_a_key_without_state_in_a_dataflow_names_the_step_by_its_uid(
    stack, capsys, monkeypatch
):
    assert cli(capsys, "run", stack.job)[0] == 0
    pipeline = load_pipeline(stack.job)
    dataflow = SimpleNamespace(  # the run's pipeline, seen as a dataflow's first keyed step
        name=pipeline.name,
        checkpoints=pipeline.checkpoints,
        uid="count",
        steps=(object(),),
        keyed_uids=("count", "remind"),
    )
    monkeypatch.setattr(microbatch.cli_inspect, "_load_pipeline", lambda ref: dataflow)

    code, _, err = cli(capsys, "state", stack.job, "nobody")
    assert code == 6
    assert "key 'nobody' has no state and no timers in the first keyed step 'count' at " in err
    assert f"in key-group {key_group('nobody', 8)} of 8" in err

    code, _, err = cli(capsys, "state", stack.job, "nobody", "--step", "count")
    assert code == 6 and "in the first keyed step 'count' at " in err

    code, _, err = cli(capsys, "state", stack.job, "nobody", "--step", "nope")
    assert code == 6
    assert "has no keyed step 'nope' (its steps: 'count', 'remind')" in err


def test_state_not_found_is_a_json_error_with_its_reason(stack, capsys):
    assert cli(capsys, "run", stack.job)[0] == 0

    code, out, _ = cli(capsys, "state", stack.job, "42", "--json")

    assert code == 6
    error = json.loads(out)["error"]
    assert error["reason"] == "not_found" and error["exit_code"] == 6
    assert "key '42' has no state" in error["message"]
    assert "(an int key? pass --int-key)" in error["message"]


def test_state_before_any_checkpoint_or_of_a_checkpoint_not_retained_is_not_found(stack, capsys):
    code, _, err = cli(capsys, "state", stack.job, "ann")
    assert code == 6
    assert "pipeline 'counts' has no checkpoint yet in" in err
    assert f"`microbatch run {stack.job}`" in err

    assert cli(capsys, "run", stack.job)[0] == 0
    code, _, err = cli(capsys, "state", stack.job, "ann", "--checkpoint", "7")
    assert code == 6
    assert "has no checkpoint 7 in" in err and "the retained ones are 0..0" in err


# status after a killed run ----------------------------------------------------------------
def test_status_after_a_killed_run_shows_its_lease_and_the_plan_to_replay(stack, capsys):
    assert cli(capsys, "run", stack.job)[0] == 0
    stack.log.produce(0, "bob", "eve")
    code, _, _ = cli(capsys, "run", stack.job, "--run-id", "killed", "--crash-at", "after_plan")
    assert code == 1  # died after planning: the lease stays, as a SIGKILL leaves it

    code, out, _ = cli(capsys, "status", stack.job, "--json")

    assert code == 0
    status = json.loads(out)
    lease = status["lease"]
    assert (lease["run_id"], lease["epoch"], lease["released"]) == ("killed", 2, False)
    assert lease["held"] is True and lease["expired"] is False
    assert lease["timeout_s"] == 60  # the pipeline's lease_timeout_s
    plan = status["stored_plan"]
    assert {k: plan[k] for k in ("batch_id", "phase", "ranges", "records", "parallelism")} == {
        "batch_id": 1, "phase": "planned", "ranges": 1, "records": 2, "parallelism": 2,
    }  # fmt: skip
    assert plan["offsets"] == [{"partition": "clicks[0]", "from": 3, "until": 5}]
    assert plan["replayed_by_next_run"] is True
    assert plan["planned_at_iso"] == iso(plan["planned_at"])

    code, shown, _ = cli(capsys, "status", stack.job)
    assert code == 0
    lines = shown.splitlines()
    assert lines[3].startswith("  lease: held by run 'killed' (epoch 2) until ")
    assert lines[3].endswith(
        "renewed while that run lives): other runs are refused; if it is dead, "
        "`microbatch unlock` ends the lease now"
    )
    assert lines[4].startswith(
        "  stored plan: batch 1 (1 range, up to 2 records, parallelism 2, planned "
    )
    assert lines[4].endswith("has no checkpoint yet: the next run replays this plan")
    assert lines[5] == "    offsets: clicks[0] [3, 5)"


def test_status_says_when_the_killed_runs_lease_has_expired(stack, capsys):
    assert cli(capsys, "run", stack.job, "--run-id", "killed", "--crash-at", "after_plan")[0] == 1
    pipeline = load_pipeline(stack.job)
    held = pipeline_status(pipeline, stack.store, lambda: nullcontext(stack.log))["lease"]
    later = held["expires_at"] + 35_000

    status = pipeline_status(pipeline, stack.store, lambda: nullcontext(stack.log), later)
    print_status(status, later)

    assert status["lease"]["expired"] is True and status["lease"]["held"] is False
    assert capsys.readouterr().out.splitlines() == [
        f"pipeline counts: no checkpoint yet in {stack.store.url}",
        f"  lease: held by run 'killed' (epoch 1) until {iso(held['expires_at'])[:19]}+00:00, "
        "expired 35 s ago: that run stopped renewing it (killed?); the next run takes it over "
        "once it has watched it unchanged for the lease timeout (60 s)",
        f"  stored plan: batch 0 (2 ranges, up to 5 records, parallelism 2, planned "
        f"{iso(status['stored_plan']['planned_at'])[:19]}+00:00) has no checkpoint yet: the "
        "next run replays this plan",
        "    offsets: clicks[0] [0, 3), clicks[1] [0, 2)",
    ]


def test_status_lists_the_first_ranges_of_a_large_stored_plan_and_counts_the_rest(capsys):
    offsets = [{"partition": f"clicks[{p}]", "from": p, "until": 10 + p} for p in range(6)]
    plan = {"batch_id": 3, "phase": "executed", "ranges": 6, "records": 60, "offsets": offsets,
            "parallelism": None, "planned_at": None, "until": None}  # fmt: skip
    status = {"pipeline": "p", "checkpoint": None, "checkpoints_url": "/cp", "lease": None,
              "stored_plan": plan}  # fmt: skip

    print_status(status, 0)

    assert capsys.readouterr().out.splitlines()[2:] == [
        "  stored plan: batch 3 (6 ranges, up to 60 records) has no checkpoint yet (an attempt "
        "executed it but did not commit): the next run replays this plan",
        "    offsets: clicks[0] [0, 10), clicks[1] [1, 11), clicks[2] [2, 12), clicks[3] [3, 13) "
        "and 2 more (--json lists them all)",
    ]

    print_status(status | {"stored_plan": plan | {"ranges": 0, "records": 0, "offsets": []}}, 0)

    assert capsys.readouterr().out.splitlines()[-1] == (
        "    offsets: none (no new records: the batch only fires timers and advances time)"
    )


def test_status_of_a_pipeline_at_rest_shows_a_free_lease_and_no_stored_plan(stack, capsys):
    code, out, _ = cli(capsys, "status", stack.job, "--json")
    assert code == 0
    assert json.loads(out) | {"checkpoints_url": "-"} == {
        "pipeline": "counts", "checkpoint": None, "checkpoints_url": "-",
        "lease": None, "stored_plan": None,
    }  # fmt: skip

    assert cli(capsys, "run", stack.job)[0] == 0
    _, shown, _ = cli(capsys, "status", stack.job)
    assert "  lease: free (released by run 'cli-" in shown
    assert "stored plan" not in shown
