"""The ``microbatch`` commands that look at a pipeline without changing it: ``status``,
``checkpoints`` and ``state``, and the time format of every command's output.

Times: in ``--json`` output every time is epoch milliseconds, with an ISO-8601 companion
(UTC, to the millisecond) right after it — ``watermark`` and ``watermark_iso``,
``created_at`` and ``created_at_iso``, ... (:func:`with_iso`); a time that is unknown is
``null`` in both. The readable output shows ISO-8601 to the second (:func:`fmt_ms`).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import time
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from typing import Any

from microbatch.errors import NotFoundError

_EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)


# Times ---------------------------------------------------------------------------------
def iso(ms: int | None) -> str | None:
    """Epoch ``ms`` as ISO-8601 in UTC to the millisecond (exact: no float rounding)."""
    if ms is None:
        return None
    return (_EPOCH + dt.timedelta(milliseconds=ms)).isoformat(timespec="milliseconds")


def fmt_ms(ms: int | None) -> str:
    """Epoch ``ms`` for people: ISO-8601 to the second, ``-`` when unknown."""
    if ms is None:
        return "-"
    return (_EPOCH + dt.timedelta(milliseconds=ms)).isoformat(timespec="seconds")


def iso_to_ms(text: str | None) -> int | None:
    """Epoch ms of an ISO-8601 time a manifest recorded (naive = UTC); None if unreadable,
    so an old or hand-written manifest never breaks a listing."""
    if not text:
        return None
    try:
        t = dt.datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return None
    if t.tzinfo is None:
        t = t.replace(tzinfo=dt.UTC)
    return (t - _EPOCH) // dt.timedelta(milliseconds=1)


def with_iso(body: Mapping[str, Any], *fields: str) -> dict[str, Any]:
    """``body`` with ``<field>_iso`` right after each of ``fields`` (epoch ms, or a list of
    them): the one time format of every ``--json`` output."""
    out: dict[str, Any] = {}
    for name, value in body.items():
        out[name] = value
        if name in fields:
            out[f"{name}_iso"] = [iso(v) for v in value] if isinstance(value, list) else iso(value)
    return out


def _ago(ms: int, now_ms: int) -> str:
    seconds = abs(now_ms - ms) // 1000
    span = f"{seconds} s" if seconds < 120 else f"{seconds // 60} min"
    return f"{span} ago" if ms <= now_ms else f"in {span}"


def table(rows: list[dict[str, Any]], columns: list[str]) -> str:
    """A plain text table."""
    cells = [[str(r.get(c, "")) for c in columns] for r in rows]
    widths = [max([len(c)] + [len(row[i]) for row in cells]) for i, c in enumerate(columns)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)) for row in cells]
    return "\n".join(lines)


def checkpoint_store(pipeline: Any, settings: Any) -> Any:
    """The object store of ``pipeline``'s checkpoints."""
    from microbatch.storage import open_store

    return open_store(pipeline.checkpoints, settings)


def _load_pipeline(ref: str) -> Any:
    from microbatch.jobfile import load_pipeline

    return load_pipeline(ref)


# status --------------------------------------------------------------------------------
def cmd_status(args: argparse.Namespace, settings: Any) -> dict[str, Any]:
    from microbatch.kafka import KafkaBrokerView

    pipeline = _load_pipeline(args.pipeline)
    return pipeline_status(
        pipeline,
        checkpoint_store(pipeline, settings),
        lambda: KafkaBrokerView.for_settings(settings),
    )


def pipeline_status(
    pipeline: Any,
    store: Any,
    broker: Callable[[], AbstractContextManager[Any]],
    now_ms: int | None = None,
) -> dict[str, Any]:
    """Where ``pipeline`` stands: its last checkpoint and lag per partition (asking the
    ``broker`` only if there is a checkpoint), who holds its lease, and the stored plan of
    a batch that has not committed (a killed or dry run's), which the next run replays."""
    from microbatch.checkpoint import Layout, latest_manifest
    from microbatch.kafka import partition_lag
    from microbatch.runtime.records import BatchRecord

    now_ms = int(time.time() * 1000) if now_ms is None else now_ms
    m = latest_manifest(store, Layout())
    waiting = {
        "lease": lease_view(store, now_ms),
        "stored_plan": stored_plan_view(store, 0 if m is None else m.checkpoint_id + 1),
    }
    if m is None:
        nothing_yet = {"pipeline": pipeline.name, "checkpoint": None, "checkpoints_url": store.url}
        return nothing_yet | waiting
    record = BatchRecord.of(m)
    offsets = record.offsets
    with broker() as view:
        end = view.end_offsets(list(offsets))
    lag = partition_lag(end, offsets)
    status = {
        "pipeline": pipeline.name,
        "checkpoints_url": store.url,
        "checkpoint": m.checkpoint_id,
        "created_at": iso_to_ms(m.created_at),
        "parallelism": m.parallelism,
        "max_parallelism": m.max_parallelism,
        "watermark": record.watermark,
        "state_bytes": m.total_bytes,
        "state_keys": m.total_keys,
        "last_batch": {} if record.stats is None else record.stats.to_json(),
        "partitions": [
            {"partition": str(tp), "committed": offsets[tp], "end": end.get(tp), "lag": lag[tp]}
            for tp in sorted(lag)
        ],
        **waiting,
    }
    return with_iso(status, "created_at", "watermark")


def lease_view(store: Any, now_ms: int) -> dict[str, Any] | None:
    """The pipeline's lease (None if no run has taken it): its holder's run id and epoch,
    when it expires, and whether it has expired or been released; ``timeout_s``, how long
    the next run watches an unreleased lease unchanged before it takes it over (None for
    a lease written by an earlier version)."""
    from microbatch.runtime.fence import read_lease

    lease = read_lease(store)
    if lease is None:
        return None
    expired = lease.has_expired(now_ms)
    view = {
        "run_id": lease.owner,
        "epoch": lease.epoch,
        "acquired_at": lease.acquired_ms,
        "expires_at": lease.expires_ms,
        "timeout_s": lease.timeout_ms / 1000 if lease.timeout_ms else None,
        "released": lease.released,
        "expired": expired,
        "held": not (lease.released or expired),
    }
    return with_iso(view, "acquired_at", "expires_at")


def stored_plan_view(store: Any, batch_id: int) -> dict[str, Any] | None:
    """The stored plan of ``batch_id`` (the batch after the last checkpoint), None if
    there is none: a run was killed (or a dry run planned it) before its commit, and the
    next run reads exactly these ranges again, at the parallelism recorded with it."""
    from microbatch.checkpoint import Layout
    from microbatch.kafka import PlanStore
    from microbatch.runtime.options import RunSpec
    from microbatch.runtime.phases import Phase, phase_of
    from microbatch.storage import ObjectNotFoundError

    phase = phase_of(store, Layout(), batch_id)
    plan = None if phase is Phase.NEW else PlanStore(store).load(batch_id)
    if plan is None:
        return None
    try:
        spec = RunSpec.from_json(json.loads(store.get(Layout().spec_key(batch_id))))
    except ObjectNotFoundError:
        spec = None
    view = {
        "batch_id": plan.batch_id,
        "phase": phase.value,  # "planned", or "executed": an attempt wrote state, no commit
        "ranges": len(plan.ranges),
        "records": plan.records,
        "offsets": [  # what the replay reads: [from, until) of each partition
            {"partition": str(r.tp), "from": r.start, "until": r.end} for r in plan.ranges
        ],
        "parallelism": None if spec is None else spec.parallelism,
        "planned_at": plan.created_at or None,
        "until": plan.until_timestamp_ms,
        "replayed_by_next_run": True,
    }
    return with_iso(view, "planned_at", "until")


def print_status(s: dict[str, Any], now_ms: int | None = None) -> None:
    """``status`` for people."""
    now_ms = int(time.time() * 1000) if now_ms is None else now_ms
    lines = []
    if s["checkpoint"] is None:
        lines.append(f"pipeline {s['pipeline']}: no checkpoint yet in {s['checkpoints_url']}")
    else:
        stats = s["last_batch"]
        lines += [
            f"pipeline {s['pipeline']}: checkpoint {s['checkpoint']} at {fmt_ms(s['created_at'])}",
            f"  parallelism {s['parallelism']} of max {s['max_parallelism']}, watermark "
            f"{fmt_ms(s['watermark'])}, state {s['state_keys']} keys / {s['state_bytes']} bytes",
            f"  last batch: {stats.get('records_in', 0)} records in, outputs "
            f"{stats.get('outputs', {})}, {stats.get('dead_letters', 0)} dead letters",
        ]
    lines.append(f"  lease: {_lease_line(s['lease'], now_ms)}")
    if s["stored_plan"] is not None:
        lines.append(f"  stored plan: {_plan_line(s['stored_plan'])}")
        lines.append(f"    offsets: {_offsets_line(s['stored_plan']['offsets'])}")
    print("\n".join(lines))
    if s["checkpoint"] is not None:
        print()
        print(table(s["partitions"], ["partition", "committed", "end", "lag"]))


def _lease_line(lease: dict[str, Any] | None, now_ms: int) -> str:
    if lease is None:
        return "free (no run holds it)"
    who = f"run {lease['run_id']!r} (epoch {lease['epoch']})"
    until = fmt_ms(lease["expires_at"])
    if lease["released"]:
        return f"free (released by {who} at {until})"
    if lease["expired"]:
        timeout = f" ({lease['timeout_s']:g} s)" if lease.get("timeout_s") else ""
        return (
            f"held by {who} until {until}, expired {_ago(lease['expires_at'], now_ms)}: that "
            "run stopped renewing it (killed?); the next run takes it over once it has "
            f"watched it unchanged for the lease timeout{timeout}"
        )
    return (
        f"held by {who} until {until} ({_ago(lease['expires_at'], now_ms)}; renewed while "
        "that run lives): other runs are refused; if it is dead, `microbatch unlock` ends "
        "the lease now"
    )


def _plan_line(plan: dict[str, Any]) -> str:
    what = [
        f"{plan['ranges']} range{'' if plan['ranges'] == 1 else 's'}",
        f"up to {plan['records']} records",
    ]
    if plan["parallelism"] is not None:
        what.append(f"parallelism {plan['parallelism']}")
    if plan["until"] is not None:
        what.append(f"interval until {fmt_ms(plan['until'])}")
    if plan["planned_at"] is not None:
        what.append(f"planned {fmt_ms(plan['planned_at'])}")
    how = "an attempt executed it but did not commit" if plan["phase"] == "executed" else ""
    return (
        f"batch {plan['batch_id']} ({', '.join(what)}) has no checkpoint yet"
        f"{f' ({how})' if how else ''}: the next run replays this plan"
    )


def _offsets_line(offsets: list[dict[str, Any]], shown: int = 4) -> str:
    """``clicks[0] [3, 5), clicks[1] [2, 4)``: the first ``shown`` ranges of a plan."""
    if not offsets:
        return "none (no new records: the batch only fires timers and advances time)"
    ranges = [f"{o['partition']} [{o['from']}, {o['until']})" for o in offsets[:shown]]
    more = len(offsets) - shown
    return ", ".join(ranges) + (f" and {more} more (--json lists them all)" if more > 0 else "")


# checkpoints ---------------------------------------------------------------------------
def cmd_checkpoints(args: argparse.Namespace, settings: Any) -> dict[str, Any]:
    from microbatch.checkpoint import Layout, list_checkpoints, load_manifest
    from microbatch.runtime.records import BatchRecord, BatchStats

    pipeline = _load_pipeline(args.pipeline)
    store = checkpoint_store(pipeline, settings)
    rows = []
    for cid in list_checkpoints(store, Layout()):
        m = load_manifest(store, Layout(), cid)
        record = BatchRecord.of(m)
        stats = record.stats or BatchStats()
        row = {
            "checkpoint": cid,
            "created_at": iso_to_ms(m.created_at),
            "parallelism": m.parallelism,
            "records_in": stats.records_in,
            "dead_letters": stats.dead_letters,
            "watermark": record.watermark,
            "state_bytes": m.total_bytes,
            "full": m.full_checkpoint_id == cid,
        }
        rows.append(with_iso(row, "created_at", "watermark"))
    return {"pipeline": pipeline.name, "checkpoints": rows}


def print_checkpoints(out: dict[str, Any]) -> None:
    """``checkpoints`` for people: one row per checkpoint, times to the second."""
    rows = [
        r | {"created_at": fmt_ms(r["created_at"]), "watermark": fmt_ms(r["watermark"])}
        for r in out["checkpoints"]
    ]
    cols = ["checkpoint", "created_at", "parallelism", "records_in", "dead_letters"]
    print(table(rows, [*cols, "watermark", "state_bytes", "full"]))


# state ---------------------------------------------------------------------------------
def cmd_state(args: argparse.Namespace, settings: Any) -> dict[str, Any]:
    """One key's state and timers; :class:`NotFoundError` if the key has none (or the
    checkpoint asked for does not exist), saying where it looked."""
    from microbatch.checkpoint import Layout, list_checkpoints
    from microbatch.checkpoint.inspection import inspect_key
    from microbatch.runtime.steps import sink_only

    pipeline = _load_pipeline(args.pipeline)
    store = checkpoint_store(pipeline, settings)
    key: Any = int(args.key) if args.int_key else args.key
    where = f"pipeline {pipeline.name!r}"
    if sink_only(pipeline):
        raise NotFoundError(
            f"{where} has no keyed step (its sources feed its sinks only), so no key has state"
        )
    retained = list_checkpoints(store, Layout())
    if not retained:
        raise NotFoundError(
            f"{where} has no checkpoint yet in {store.url}, so no key has state: run a batch "
            f"first (`microbatch run {args.pipeline}`)"
        )
    if args.checkpoint is not None and args.checkpoint not in retained:
        raise NotFoundError(
            f"{where} has no checkpoint {args.checkpoint} in {store.url}: the retained ones "
            f"are {retained[0]}..{retained[-1]} (`microbatch checkpoints {args.pipeline}`)"
        )
    checkpoint = retained[-1] if args.checkpoint is None else args.checkpoint
    step = getattr(args, "step", None)
    if step is not None and step not in pipeline.keyed_uids:
        uids = ", ".join(repr(u) for u in pipeline.keyed_uids if u)
        raise NotFoundError(f"{where} has no keyed step {step!r} (its steps: {uids or 'none'})")
    if step == pipeline.uid:
        step = None
    found = inspect_key(store, Layout(), key, checkpoint, step)
    if not pipeline.steps:
        looked_in = "any operator"
    elif step is not None:
        looked_in = f"step {step!r}"
    else:  # named by its uid when it has one
        looked_in = "the first keyed step" + (f" {pipeline.uid!r}" if pipeline.uid else "")
    if found.empty:
        hint = (
            " (an int key? pass --int-key)"
            if isinstance(key, str) and key.lstrip("-").isdigit()
            else ""
        )
        raise NotFoundError(
            f"{where}: key {key!r} has no state and no timers in {looked_in} at checkpoint "
            f"{found.checkpoint_id} ({store.url}); it would be in key-group {found.key_group} "
            f"of {found.max_parallelism} (instance {found.instance} of {found.parallelism}). "
            f"Check the key's spelling and type{hint}, or look at an older checkpoint with "
            "--checkpoint"
        )
    return with_iso(
        {
            "pipeline": pipeline.name,
            "key": key,
            "checkpoint": found.checkpoint_id,
            "key_group": found.key_group,
            "step": step or pipeline.uid,
            "state": found.values,
            "timers": found.timers,
        },
        "timers",
    )


def print_state(out: dict[str, Any]) -> None:
    """``state`` for people: one line per state, timers as times."""
    print(
        f"pipeline {out['pipeline']}: key {out['key']!r} at checkpoint {out['checkpoint']} "
        f"(key-group {out['key_group']})"
    )
    for name, value in out["state"].items():
        print(f"  {name}: {json.dumps(value, default=str)}")
    if out["timers"]:
        print(f"  timers: {', '.join(fmt_ms(t) for t in out['timers'])}")
