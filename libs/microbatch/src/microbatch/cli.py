"""The ``microbatch`` command: run a batch, look at a pipeline, fix it.

A pipeline is named by reference: ``path/to/job.py`` or ``path/to/job.py:attr`` or
``package.module:attr`` (``attr`` defaults to ``pipeline``)::

    microbatch run jobs/clickstream.py --parallelism 3
    microbatch run jobs/clickstream.py --until 2026-11-23T10:05:00Z --dry-run
    microbatch status jobs/clickstream.py
    microbatch checkpoints jobs/clickstream.py --json
    microbatch state jobs/clickstream.py user-42
    microbatch reshard jobs/clickstream.py
    microbatch replay jobs/clickstream.py --from-checkpoint 12
    microbatch unlock jobs/clickstream.py

Every command prints a readable table, or JSON with ``--json``; in JSON every time is
epoch milliseconds with an ISO-8601 companion next to it (``watermark`` and
``watermark_iso``: :mod:`microbatch.cli_inspect`). An error prints one line naming what
went wrong on stderr (with ``--json`` also ``{"error": {"reason", "message",
"exit_code"}}`` on stdout) and exits with the code of its cause
(:class:`microbatch.errors.ExitCode`): 1 batch failed, 2 configuration, 3 lease held by
another run, 4 service unreachable, 5 Kafka deleted records the batch must read, 6 what
``state`` was asked for does not exist (``not_found``).
``microbatch --version`` prints the library's version.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import logging
import os
import sys
import time
from typing import Any, NoReturn

from microbatch import __version__
from microbatch.cli_inspect import (
    checkpoint_store,
    cmd_checkpoints,
    cmd_state,
    cmd_status,
    fmt_ms,
    print_checkpoints,
    print_state,
    print_status,
    with_iso,
)
from microbatch.errors import ConfigError, ExitCode, MicrobatchError, exit_code


def load_pipeline(ref: str) -> Any:
    """The Pipeline ``ref`` points at, built from this process's settings and environment
    (a job file's ``pipeline`` may be a function of them: see :mod:`microbatch.jobfile`)."""
    from microbatch.jobfile import load_pipeline as load_job_pipeline

    return load_job_pipeline(ref)


def parse_time_ms(text: str) -> int:
    """Epoch ms from an int or an ISO-8601 time (naive = UTC)."""
    if text.lstrip("-").isdigit():
        return int(text)
    try:
        t = dt.datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise ConfigError(f"not an ISO-8601 time or epoch ms: {text!r}") from None
    if t.tzinfo is None:
        t = t.replace(tzinfo=dt.UTC)
    return int(t.timestamp() * 1000)


def cmd_run(args: argparse.Namespace, settings: Any) -> dict[str, Any]:
    from microbatch import metrics
    from microbatch.datasets import pipeline_lineage
    from microbatch.runtime import BatchOptions, BatchRunner
    from microbatch.spark import spark_session

    pipeline = load_pipeline(args.pipeline)
    options = BatchOptions(
        until_timestamp_ms=parse_time_ms(args.until) if args.until else None,
        interval_start_ms=parse_time_ms(args.interval_start) if args.interval_start else None,
        backfill=args.backfill,
        accept_kafka_repeats=args.accept_kafka_repeats,
        parallelism=args.parallelism,
        max_records_per_batch=args.max_records,
        dry_run=args.dry_run,
        run_id=args.run_id,
        crash_at=args.crash_at,
        replan=args.replan,
    )
    session: list[Any] = []

    def spark() -> Any:  # started when a batch first executes: a dry run never starts Spark
        if not session:
            _progress(args, f"starting Spark ({settings.spark_master}) for {pipeline.name!r}")
            session.append(spark_session(settings, app_name=f"microbatch-{pipeline.name}"))
        return session[0]

    lineage = pipeline_lineage(pipeline, settings)  # what the batch reads and writes
    metrics.setup_from_env()  # OTLP export when OTEL_EXPORTER_OTLP_ENDPOINT is set
    batch_metrics = metrics.BatchMetrics()
    results = []
    for n in range(args.batches):
        # The loop's count, worded apart from the batch id the result line names next.
        _progress(args, f"run {n + 1} of {args.batches}: planning the next batch ...")
        try:
            batch = BatchRunner(spark, pipeline, settings).run(options)
        except Exception as e:
            batch_metrics.record_failure(exit_code(e).reason, pipeline.name)
            raise
        committed = batch.status == "committed" and batch_metrics.exporting
        batch_metrics.record(batch, _batch_stats(pipeline, settings, batch) if committed else None)
        result = with_iso(batch.to_json(), "watermark") | {"lineage": lineage}
        results.append(result)
        _progress(args, _run_line(result))
        if not args.json:  # for callers that parse the log (the Airflow operator)
            print("MICROBATCH_RESULT " + json.dumps(result), flush=True)
    return {"batches": results}


def _batch_stats(pipeline: Any, settings: Any, batch: Any) -> Any:
    """The committed checkpoint's stats of ``batch`` (its enrichment counters), for metrics."""
    from microbatch.checkpoint import Layout, load_manifest
    from microbatch.runtime.records import BatchRecord

    return BatchRecord.of(
        load_manifest(checkpoint_store(pipeline, settings), Layout(), batch.batch_id)
    ).stats


def _run_line(r: dict[str, Any]) -> str:
    """One line per batch, what a task log reader wants: e.g. ``batch 5 committed in
    3.2 s: 17 records in, 1 dead letter (malformed 1), out sessions=6 sessions_topic=6,
    watermark 2026-11-26T09:52:00+00:00, parallelism 2, replayed the stored plan``."""
    letters = r.get("dead_letters", 0)
    reasons = r.get("dead_letter_reasons") or {}
    why = f" ({', '.join(f'{k} {v}' for k, v in sorted(reasons.items()))})" if reasons else ""
    outputs = " ".join(f"{name}={n}" for name, n in (r.get("outputs") or {}).items()) or "none"
    parts = [
        f"{r['records_in']} records in",
        f"{letters} dead letter{'' if letters == 1 else 's'}{why}",
        f"out {outputs}",
        f"watermark {fmt_ms(r.get('watermark'))}",
        f"parallelism {r['parallelism']}",
    ]
    if r.get("replayed"):
        parts.append("replayed the stored plan of an earlier attempt")
    rewind = r.get("rewind")
    if rewind:
        first, last = rewind.get("undone") or ["?", "?"]
        parts.append(f"rewound to checkpoint {rewind.get('to_checkpoint')} (undid {first}..{last})")
    if r.get("recovered_publish") is not None:
        parts.append(f"published checkpoint {r['recovered_publish']} first")
    seconds = (r.get("seconds") or {}).get("total", 0)
    return f"batch {r['batch_id']} {r['status']} in {seconds:.1f} s: {', '.join(parts)}"


def _progress(args: argparse.Namespace, text: str) -> None:
    if not args.json:
        print(text, file=sys.stderr, flush=True)


def cmd_reshard(args: argparse.Namespace, settings: Any) -> dict[str, Any]:
    from microbatch.checkpoint import Layout, latest_manifest, reshard
    from microbatch.runtime import fence
    from microbatch.runtime.publish import recover
    from microbatch.runtime.records import BatchRecord, ReshardOrigin

    pipeline = load_pipeline(args.pipeline)
    store = checkpoint_store(pipeline, settings)
    owner = f"reshard-{time.time_ns()}"
    with fence.lease(store, pipeline.name, owner, pipeline.lease_timeout_s) as held:
        m = latest_manifest(store, Layout())
        if m is None:
            raise ConfigError(f"pipeline {pipeline.name!r} has no checkpoint to reshard")
        # A crash between its commit and its publish: publish it first, or the copy (which
        # has no output of its own) would leave its output unpublished.
        recover(store, Layout(), pipeline, settings, m, held)
        target = args.max_parallelism or pipeline.max_parallelism
        if target == m.max_parallelism:
            raise ConfigError(
                f"checkpoint {m.checkpoint_id} already has max_parallelism {target}; change "
                "max_parallelism in the pipeline (or pass --max-parallelism) first"
            )
        record = dataclasses.replace(
            BatchRecord.of(m), resharded_from=ReshardOrigin(m.checkpoint_id, m.max_parallelism)
        )
        held.check("the reshard's commit")
        result = reshard(store, Layout(), m.checkpoint_id, target, metadata=record.to_json())
    return {
        "pipeline": pipeline.name,
        "from_checkpoint": m.checkpoint_id,
        "to_checkpoint": result.target.checkpoint_id,
        "max_parallelism": [m.max_parallelism, target],
        "keys": result.keys,
    }


def cmd_replay(args: argparse.Namespace, settings: Any) -> dict[str, Any]:
    from microbatch.runtime.protocol import BatchRunner
    from microbatch.runtime.records import BatchRecord

    pipeline = load_pipeline(args.pipeline)
    runner = BatchRunner(None, pipeline, settings)  # a rollback needs no Spark
    m = runner.replay_from(
        args.from_checkpoint, run_id=args.run_id, accept_kafka_repeats=args.accept_kafka_repeats
    )
    return {
        "pipeline": pipeline.name,
        "checkpoint": m.checkpoint_id,
        "replayed_from": BatchRecord.of(m).replayed_from.to_json(),  # type: ignore[union-attr]
    }


def cmd_unlock(args: argparse.Namespace, settings: Any) -> dict[str, Any]:
    from microbatch.checkpoint import Layout

    pipeline = load_pipeline(args.pipeline)
    store = checkpoint_store(pipeline, settings)
    held = store.exists(Layout().lease_key)
    store.delete(Layout().lease_key)
    return {"pipeline": pipeline.name, "released": held}


def cmd_optimize(args: argparse.Namespace, settings: Any) -> dict[str, Any]:
    """Compact a Delta or Iceberg sink's files per batch (and vacuum, or expire snapshots),
    holding the pipeline's lease, after publishing a committed batch: no batch runs
    meanwhile, none is half published."""
    from microbatch.checkpoint import Layout, latest_manifest
    from microbatch.runtime import fence
    from microbatch.runtime.publish import recover
    from microbatch.sinks.delta import DeltaSink
    from microbatch.sinks.iceberg import IcebergSink

    pipeline = load_pipeline(args.pipeline)
    sink = pipeline.sink(args.sink)
    if not isinstance(sink, DeltaSink | IcebergSink):
        raise ConfigError(
            f"sink {sink.name!r} is a {type(sink).__name__}, not a DeltaSink or an IcebergSink"
        )
    store = checkpoint_store(pipeline, settings)
    owner = f"optimize-{time.time_ns()}"
    with fence.lease(store, pipeline.name, owner, pipeline.lease_timeout_s) as held:
        newest = latest_manifest(store, Layout())
        if newest is not None:
            recover(store, Layout(), pipeline, settings, newest, held)
        target = sink.target(settings, pipeline.name)
        # A stalled optimize must not commit after its lease passed to a batch run: the
        # run's publish and GC no longer expect it.
        summary = target.optimize(args.dry_run, lambda: held.check("the optimize's commit"))
        out = {"pipeline": pipeline.name, "sink": sink.name, **summary}
        if args.vacuum:
            held.check("the vacuum")
            out["vacuumed"] = target.vacuum(args.retention_hours, dry_run=args.dry_run)
    return out


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="microbatch", description=__doc__.split("\n")[0])
    p.add_argument("--version", action="version", version=f"microbatch {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    def add(name: str, help_text: str) -> argparse.ArgumentParser:
        s = sub.add_parser(name, help=help_text)
        s.add_argument("pipeline", help="path/to/job.py[:attr] or package.module[:attr]")
        s.add_argument("--json", action="store_true", help="machine-readable output")
        return s

    run = add("run", "run the next batch(es)")
    run.add_argument("--until", help="data-interval end (ISO-8601 or epoch ms)")
    run.add_argument("--interval-start", help="data-interval start (recorded; see --backfill)")
    run.add_argument(
        "--backfill",
        action="store_true",
        help="reprocess the interval: rewind first to the checkpoint that ended at "
        "--interval-start if the pipeline is past it",
    )
    run.add_argument(
        "--accept-kafka-repeats",
        action="store_true",
        help="with --backfill: rewind even though Kafka sinks receive the outputs again",
    )
    run.add_argument("--parallelism", type=int, help="operator instances for this batch")
    run.add_argument("--max-records", type=int, help="cap on records in this batch")
    run.add_argument("--batches", type=int, default=1, help="how many batches to run")
    run.add_argument("--dry-run", action="store_true", help="plan only: show ranges and lag")
    run.add_argument("--run-id", help="owner of the lease (a retry of the same run reuses it)")
    run.add_argument(
        "--replan",
        action="store_true",
        help="if Kafka deleted records the batch's stored plan was to read, plan it again "
        "without them (recorded as skipped) instead of failing",
    )
    run.add_argument("--crash-at", help=argparse.SUPPRESS)
    add("status", "last checkpoint, lag per partition, watermark")
    add("checkpoints", "list committed checkpoints")
    st = add("state", "state and timers of one key")
    st.add_argument("key")
    st.add_argument("--int-key", action="store_true", help="the key is an int")
    st.add_argument("--checkpoint", type=int, help="default: the latest")
    st.add_argument("--step", help="a dataflow's keyed step (its uid); default: the first")
    rs = add("reshard", "rewrite the latest checkpoint for a new max_parallelism")
    rs.add_argument("--max-parallelism", type=int, help="default: the pipeline's")
    rp = add("replay", "roll back to a checkpoint: the next batches read again after it")
    rp.add_argument("--from-checkpoint", type=int, required=True)
    rp.add_argument("--run-id", help="owner of the lease")
    rp.add_argument(
        "--accept-kafka-repeats",
        action="store_true",
        help="replay even though Kafka sinks receive the undone outputs again",
    )
    add("unlock", "end the lease now (else the next run takes it over after one lease timeout)")
    op = add("optimize", "compact a Delta or Iceberg sink's files per batch (exactly-once kept)")
    op.add_argument("--sink", required=True, help="the DeltaSink's or IcebergSink's name")
    op.add_argument("--vacuum", action="store_true", help="then delete unreferenced files")
    op.add_argument("--retention-hours", type=float, default=168.0, help="vacuum: min age")
    op.add_argument("--dry-run", action="store_true", help="only say what would change")
    return p


COMMANDS = {
    "run": cmd_run,
    "status": cmd_status,
    "checkpoints": cmd_checkpoints,
    "state": cmd_state,
    "reshard": cmd_reshard,
    "replay": cmd_replay,
    "unlock": cmd_unlock,
    "optimize": cmd_optimize,
}


def main(argv: list[str] | None = None) -> int:
    from microbatch.settings import Settings

    words = sys.argv[1:] if argv is None else argv
    try:
        args = build_parser().parse_args(argv)
    except UsageError as e:
        return report_error(e, "microbatch", as_json="--json" in words)
    if argv is None:  # a real command line (not a caller's in-process use): log to stderr
        logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    quiet_kafka_slow_task_warnings()  # also for job files, which pass their own argv
    try:
        settings = Settings.from_env()
        out = COMMANDS[args.command](args, settings)
    except Exception as e:
        return report_error(e, f"microbatch {args.command}", as_json=getattr(args, "json", False))
    if args.json:
        print(json.dumps(out, indent=1, default=str))
    elif args.command == "status":
        print_status(out)
    elif args.command == "checkpoints":
        print_checkpoints(out)
    elif args.command == "state":
        print_state(out)
    elif args.command == "run":
        pass  # progress lines already said it all
    else:
        print(json.dumps(out, indent=1, default=str))
    return 0


def quiet_kafka_slow_task_warnings() -> None:
    """Keep kafka-python's "Task ... ran for 0.105s (>0.100s threshold). It is blocking the
    event loop" warnings out of the command's output, unless the user set that logger's
    level.

    kafka-python 3 (``kafka/net/selector.py``) times every step of its clients' IO thread
    and warns at 0.1 s. In a batch that thread shares the process with pandas, Arrow and
    Spark client work holding the GIL (and a busy machine with the JVM), so a step runs
    late through no fault of the client and nothing a user can act on. The threshold is a
    setting of the selector only (``slow_task_threshold_secs``): KafkaConsumer, Producer
    and Admin reject it as an unknown config, so the logger of that one module is raised to
    ERROR instead; its errors (a crashed IO loop, a task that raised) still show.
    """
    selector = logging.getLogger("kafka.net.selector")
    if selector.level == logging.NOTSET:
        selector.setLevel(logging.ERROR)


class UsageError(ConfigError):
    """The command line itself is wrong (argparse's complaint, with the usage line)."""


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is raised (to be reported like any other error, as JSON
    with ``--json``) instead of printed and exited on."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message}\n{self.format_usage().strip()}")


def error_message(e: BaseException) -> str:
    """What to tell the user about ``e``: its message; for an error Spark wrapped (a task
    failure arrives as a Java/Python exception around the library's), the library's part."""
    if isinstance(e, MicrobatchError):
        return str(e)
    text = str(e) or type(e).__name__
    hit = text.find("microbatch.errors.")
    return text[hit : hit + 2000] if hit >= 0 else text


def report_error(e: BaseException, prefix: str, *, as_json: bool) -> int:
    """Print ``e`` as one line on stderr (``prefix: message``, the line callers such as
    :mod:`microbatch.runner` pick up), and with ``as_json`` the error object on stdout;
    return its exit code (:func:`microbatch.errors.exit_code`)."""
    code = exit_code(e)
    message = error_message(e)
    print(f"{prefix}: {message}", file=sys.stderr, flush=True)
    if as_json:
        print(json.dumps(error_json(code, message)), flush=True)
    return int(code)


def error_json(code: ExitCode, message: str) -> dict[str, Any]:
    """The ``--json`` form of an error: ``{"error": {"reason", "message", "exit_code"}}``."""
    return {"error": {"reason": code.reason, "message": message, "exit_code": int(code)}}


def exit_now(code: int) -> NoReturn:
    """Exit a job process with ``code`` the way the interpreter would — wait for non-daemon
    threads, run the ``atexit`` handlers, flush — but without tearing down every module
    and object, which costs ~0.2 s once pyspark, pandas and boto3 are loaded: a fixed cost
    of every scheduled batch. For job files' ``__main__`` only; never inside a caller's
    process (it ends it)."""
    import atexit
    import threading

    # What the interpreter runs first: threading's exit hooks (a ThreadPoolExecutor's stop
    # its idle workers, such as pyiceberg's pool after a publish), then it joins the
    # non-daemon threads. Joining them without the hooks waited for those workers forever.
    threading._shutdown()  # type: ignore[attr-defined]
    atexit._run_exitfuncs()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)


def console() -> NoReturn:
    """The ``microbatch`` command."""
    exit_now(main())


if __name__ == "__main__":
    console()
