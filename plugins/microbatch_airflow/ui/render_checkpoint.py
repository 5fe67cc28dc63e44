"""The drill-down page of one checkpoint (``/microbatch/pipelines/<name>/checkpoints/<id>``):
what it read, counted and records about rewinds, every value escaped."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from html import escape
from typing import Any
from urllib.parse import quote

from microbatch_airflow.ui.render import cell, document, human_bytes, table

ROOT = "../../../"  # from pipelines/<name>/checkpoints/<id> back to the app's root

RANGE_COLUMNS = [
    ("topic", "topic"), ("partition", "partition"), ("from", "from"), ("until", "until"),
    ("offsets", "offsets"), ("records", "records read"), ("dead_letters", "dead letters"),
    ("skipped", "skipped (retention)"),
]  # fmt: skip
OFFSET_COLUMNS = [("topic", "topic"), ("partition", "partition"), ("offset", "offset")]
INSTANCE_COLUMNS = [("instance", "instance"), ("seconds", "phases (s)"),
                    ("counters", "counters")]  # fmt: skip
AWAITING_COLUMNS = [("batch", "undone batch"), ("ends", "its input ended at")]


def facts(rows: Sequence[tuple[str, Any]]) -> str:
    """A two-column table of labelled values (``-`` for a value not recorded)."""
    body = "".join(
        f"<tr><th>{escape(label)}</th><td>{escape(cell(value))}</td></tr>" for label, value in rows
    )
    return f'<table class="facts">{body}</table>'


def _link(href: str, text: str) -> str:
    return f'<a href="{escape(href)}">{escape(text)}</a>'


def _rows(mapping: Mapping[str, Any], key: str, value: str) -> list[dict[str, Any]]:
    return [{key: k, value: v} for k, v in mapping.items()]


def _summary(view: Mapping[str, Any]) -> str:
    batch = view["batch"] or {}
    stats = view["stats"] or {}
    interval = (
        None
        if batch.get("interval_end") is None
        else f"{batch.get('interval_start') or '-'} → {batch['interval_end']}"
    )
    full = view["full_checkpoint_id"]
    copy_of = view["rewind"]["copy_of"]
    stands_for = [] if copy_of is None else [
        ("a copy of", f"checkpoint {copy_of}: the batch facts are that batch's")
    ]  # fmt: skip
    return facts(
        [
            ("committed at", view["created_at"] or None),
            *stands_for,
            ("run id", batch.get("run_id")),
            ("planned at", batch.get("planned_at")),
            ("data interval", interval),
            ("parallelism", f"{view['parallelism']} of max {view['max_parallelism']}"),
            ("watermark", f"{view['watermark_iso']} ({cell(view['watermark'])} ms)"),
            ("records in", stats.get("records_in")),
            ("dead letters", stats.get("dead_letters")),
            ("enrichment pending", view["enrich_pending"]),
            ("enrichment re-issued", stats.get("enrich_reissued")),
            ("read by", stats.get("reader")),
            ("state", f"{view['state_keys']} keys, {human_bytes(view['state_bytes'])}"),
            ("state files", "full" if full == view["id"] else f"incremental on checkpoint {full}"),
        ]
    )


def _rewind(view: Mapping[str, Any]) -> str:
    """The checkpoint's place in the lineage: where it started, whether its plan was
    replayed, the rewind or reshard it is a copy of, and what awaits replacement."""
    batch, rewind = view["batch"] or {}, view["rewind"]
    here = f"{ROOT}pipelines/{quote(view['pipeline'], safe='')}/checkpoints/"
    items = []
    base = batch.get("base_checkpoint")
    if view["batch"] is None:
        items.append("records no batch")
    elif base is None:
        items.append("the first batch of its lineage (started from the pipeline's start)")
    else:
        items.append(f"started from checkpoint {_link(f'{here}{base}', str(base))}")
    if view["batch"] is not None:
        replayed = batch.get("replayed")
        items.append(
            "replayed: "
            + ("yes, the plan an earlier attempt stored" if replayed else "no, planned fresh")
        )
        if batch.get("interval_end") is not None:
            exact = (
                "yes" if batch.get("ends_exactly") else "no (a limit cut it, or it started past it)"
            )
            items.append(f"read exactly to its interval end: {escape(exact)}")
    replayed_from = rewind["replayed_from"]
    if replayed_from is not None:
        first, last = replayed_from["undone"]
        source = replayed_from["checkpoint_id"]
        what = (
            "the position before the first batch"
            if source is None
            else f"checkpoint {_link(f'{here}{source}', str(source))}"
        )
        items.append(
            f"replayed_from: a rewind's copy of {what}, undoing checkpoints {first}–{last}"
        )
    resharded = rewind["resharded_from"]
    if resharded is not None:
        source = resharded["checkpoint_id"]
        items.append(
            f"resharded_from: a copy of checkpoint {_link(f'{here}{source}', str(source))} "
            f"at max_parallelism {resharded['max_parallelism']}"
        )
    if rewind["supersedes"]:
        undone = ", ".join(str(b) for b in rewind["supersedes"])
        items.append(f"replaced the output of undone batches {escape(undone)}")
    out = ["<ul>" + "".join(f"<li>{item}</li>" for item in items) + "</ul>"]
    awaiting = rewind["awaiting_replacement"]
    out.append("<p>undone batches whose output awaits replacement:</p>")
    out.append(
        '<p class="muted">not recorded</p>'
        if awaiting is None
        else table(awaiting, AWAITING_COLUMNS)
    )
    return "\n".join(out)


def checkpoint_page(view: Mapping[str, Any], user: str | None = None) -> str:
    """The drill-down page of ``view`` (see :mod:`microbatch_airflow.ui.checkpoint`)."""
    name, cid = view["pipeline"], view["id"]
    nav = [_link(ROOT, "all pipelines"), _link(f"{ROOT}#{name}", name)]
    if view["previous"] is not None:
        nav.append(_link(str(view["previous"]), f"← checkpoint {view['previous']}"))
    if view["next"] is not None:
        nav.append(_link(str(view["next"]), f"checkpoint {view['next']} →"))
    stats = view["stats"]
    body = [
        f"<p>{' · '.join(nav)}</p>",
        f'<p class="muted">checkpoints {escape(view["checkpoints_url"])}</p>',
        _summary(view),
        '<h3 id="ranges">Offset ranges read</h3>',
        f'<p class="muted">from: {escape(view["ranges_from"])}</p>',
        table(view["ranges"], RANGE_COLUMNS),
        '<h3 id="offsets">Offsets after the batch</h3>',
        table(view["offsets"], OFFSET_COLUMNS),
    ]
    if stats is None:
        body.append('<p class="muted">no stats: a copy made by a rewind or reshard</p>')
    else:
        body += [
            '<h3 id="outputs">Outputs per sink</h3>',
            table(_rows(stats["outputs"], "sink", "rows"), [("sink", "sink"), ("rows", "rows")]),
            '<h3 id="dead-letters">Dead letters by reason</h3>',
            table(
                _rows(stats["dead_letter_reasons"], "reason", "count"),
                [("reason", "reason"), ("count", "dead letters")],
            ),
            '<h3 id="timings">Timings</h3>',
            f"<p>driver, up to the commit (s): {escape(cell(stats['seconds']) or '-')}</p>",
            table(stats["instances"], INSTANCE_COLUMNS),
        ]
    body += ['<h3 id="rewind">Rewind and replay</h3>', _rewind(view)]
    heading = f"{escape(name)} · checkpoint {int(cid)}"
    return document(f"Microbatch · {name} · {cid}", heading, "\n".join(body), user)
