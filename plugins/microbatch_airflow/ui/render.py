"""Self-contained HTML pages: tables and inline SVG, every value escaped.

Links between the pages are relative (``root`` leads from a page back to the app's root):
the app is mounted under Airflow's base URL, which the page does not know, and the same
pages show at ``/microbatch/...`` and inside Airflow's frame.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from html import escape
from typing import Any
from urllib.parse import quote

MAX_BARS = 256
CHART_W, CHART_H = 760, 140
COLORS = ("#2b7bb9", "#7fb2dd")

PARTITION_COLUMNS = [("partition", "partition"), ("committed", "committed"), ("end", "end"),
                     ("lag", "lag")]  # fmt: skip
CHECKPOINT_COLUMNS = [
    ("id", "id"), ("created_at", "time"), ("parallelism", "parallelism"),
    ("records_in", "records"), ("dead_letters", "dead letters"), ("state_keys", "keys"),
    ("state_bytes", "state bytes"), ("full", "full"), ("replayed", "replayed"),
]  # fmt: skip
TIMING_COLUMNS = [
    ("id", "batch"), ("at", "planned at"), ("since_previous_s", "since previous (s)"),
    ("records_in", "records"), ("batch_s", "plan to commit (s)"), ("instances", "instances"),
    ("slowest_instance_s", "slowest instance (s)"), ("phases", "its phases (s)"),
]  # fmt: skip

STYLE = """
body{font:14px system-ui,sans-serif;margin:16px;color:#1d2733}
h1{font-size:20px}h2{font-size:17px;margin:28px 0 6px}h3{font-size:14px;margin:14px 0 4px}
table{border-collapse:collapse;margin:4px 0 10px}td,th{padding:3px 10px;border-bottom:1px
solid #dde3ea;text-align:right}th{background:#f1f5f9}td:first-child,th:first-child{text-align:left}
.muted{color:#66727f}.error{color:#a4262c}.lag{font-weight:600}svg{background:#fafcfe;
border:1px solid #dde3ea}a{color:#2b7bb9}.facts th,.facts td{text-align:left}
.facts th{background:none}
"""

Link = Callable[[Mapping[str, Any]], str]
"""A row → the (relative) URL its cell links to."""


def human_bytes(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"


def checkpoint_href(root: str, pipeline: str, checkpoint_id: int) -> str:
    """The drill-down page of a checkpoint, relative to a page whose root is ``root``."""
    return f"{root}pipelines/{quote(pipeline, safe='')}/checkpoints/{int(checkpoint_id)}"


def table(
    rows: Sequence[Mapping[str, Any]],
    columns: Sequence[tuple[str, str]],
    links: Mapping[str, Link] | None = None,
) -> str:
    """Rows under titled columns; a column in ``links`` links each cell."""
    if not rows:
        return '<p class="muted">none</p>'
    head = "".join(f"<th>{escape(title)}</th>" for _, title in columns)
    body = "".join(
        "<tr>" + "".join(_td(r, key, (links or {}).get(key)) for key, _ in columns) + "</tr>"
        for r in rows
    )
    return f"<table><tr>{head}</tr>{body}</table>"


def _td(row: Mapping[str, Any], key: str, link: Link | None) -> str:
    text = escape(cell(row.get(key)))
    if link is None:
        return f"<td>{text}</td>"
    return f'<td><a href="{escape(link(row))}">{text}</a></td>'


def cell(value: Any) -> str:
    """A value as table text: ``-`` for None, ``yes``/empty for booleans."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else ""
    if isinstance(value, Mapping):
        return ", ".join(f"{k} {v}" for k, v in value.items())
    return str(value)


def key_group_chart(key_groups: Sequence[Mapping[str, Any]], parallelism: int) -> str:
    """Bars of state bytes per key-group (bucketed above ``MAX_BARS``), colored by the
    operator instance that owns them at ``parallelism``."""
    n = len(key_groups)
    if n == 0:
        return ""
    per_bar = -(-n // MAX_BARS)
    bars = []
    for start in range(0, n, per_bar):
        chunk = key_groups[start : start + per_bar]
        bars.append(
            (
                start,
                start + len(chunk) - 1,
                sum(g["bytes"] for g in chunk),
                sum(g["keys"] for g in chunk),
            )
        )
    top = max(b[2] for b in bars) or 1
    width = CHART_W / len(bars)
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{CHART_W}" height="{CHART_H + 18}" '
        f'role="img" aria-label="state bytes per key-group">'
    ]
    for i, (first, last, size, keys) in enumerate(bars):
        height = 0 if size == 0 else max(1.0, size / top * CHART_H)
        owner = first * parallelism // n if parallelism else 0
        label = f"key-group {first}" if first == last else f"key-groups {first}-{last}"
        parts.append(
            f'<rect x="{i * width:.2f}" y="{CHART_H - height:.2f}" '
            f'width="{max(width - 1, 0.5):.2f}" height="{height:.2f}" '
            f'fill="{COLORS[owner % 2]}"><title>{escape(label)}: '
            f"{escape(human_bytes(size))}, {keys} keys (instance {owner})</title></rect>"
        )
    parts.append(
        f'<text x="0" y="{CHART_H + 14}" font-size="11" fill="#66727f">0</text>'
        f'<text x="{CHART_W}" y="{CHART_H + 14}" font-size="11" fill="#66727f" '
        f'text-anchor="end">{n - 1}</text>'
        f'<text x="{CHART_W / 2}" y="{CHART_H + 14}" font-size="11" fill="#66727f" '
        f'text-anchor="middle">key-group (max {escape(human_bytes(top))} per bar)</text></svg>'
    )
    return "".join(parts)


def pipeline_section(view: Mapping[str, Any], root: str = "") -> str:
    """One pipeline: its latest checkpoint, lag, checkpoints (each linking to its
    drill-down page), timings and state size per key-group."""
    name = escape(view["name"])
    out = [f'<h2 id="{name}">{name}</h2>']
    out.append(
        f'<p class="muted">topics {escape(", ".join(view.get("topics", [])))} · checkpoints '
        f"{escape(view.get('checkpoints_url', ''))}</p>"
    )
    out += [f'<p class="error">{escape(e)}</p>' for e in view.get("errors", [])]
    latest = view.get("latest")
    if latest is None:
        if not view.get("errors"):
            out.append(f'<p class="muted">{escape(view.get("note") or "no checkpoint yet")}</p>')
        return "\n".join(out)
    total_lag = sum(p["lag"] or 0 for p in view["partitions"])
    out.append(
        f"<p>checkpoint <b>{latest['id']}</b> at {escape(latest['created_at'])} · watermark "
        f"<b>{escape(latest['watermark_iso'])}</b> · parallelism {latest['parallelism']} of max "
        f"{latest['max_parallelism']} · state {latest['state_keys']} keys, "
        f"{escape(human_bytes(latest['state_bytes']))} · lag "
        f'<span class="lag">{total_lag}</span></p>'
    )
    out.append("<h3>Lag per partition</h3>")
    out.append(table(view["partitions"], PARTITION_COLUMNS))
    out.append("<h3>Checkpoints</h3>")

    def to_checkpoint(row: Mapping[str, Any]) -> str:
        return checkpoint_href(root, view["name"], row["id"])

    out.append(table(view["checkpoints"], CHECKPOINT_COLUMNS, {"id": to_checkpoint}))
    out.append("<h3>Recent batch timings</h3>")
    out.append(table(view["timings"], TIMING_COLUMNS))
    out.append(f"<h3>State size per key-group (checkpoint {latest['id']})</h3>")
    out.append(key_group_chart(view["key_groups"], latest["parallelism"]))
    return "\n".join(out)


def document(title: str, heading: str, body: str, user: str | None = None) -> str:
    """The HTML shell every page shares (``heading`` is HTML: callers escape it)."""
    who = f' <span class="muted">signed in as {escape(user)}</span>' if user else ""
    return (
        f'<!doctype html><html><head><meta charset="utf-8"><title>{escape(title)}</title>'
        f"<style>{STYLE}</style></head><body><h1>{heading}{who}</h1>{body}</body></html>"
    )


def page(views: Iterable[Mapping[str, Any]], user: str | None = None) -> str:
    """Every pipeline (the nav view, ``/microbatch/``)."""
    views = list(views)
    nav = " · ".join(f'<a href="#{escape(v["name"])}">{escape(v["name"])}</a>' for v in views)
    sections = "\n".join(pipeline_section(v) for v in views) or (
        '<p class="muted">no pipelines yet: declare a DAG with microbatch_dag(), '
        "or set [microbatch] pipelines</p>"
    )
    return document("Microbatch", "Microbatch pipelines", f"<p>{nav}</p>{sections}", user)


def dag_page(dag_id: str, views: Sequence[Mapping[str, Any]], user: str | None = None) -> str:
    """The pipelines DAG ``dag_id`` runs (its tab, ``/microbatch/dags/<dag_id>``)."""
    root = "../"
    sections = "\n".join(pipeline_section(v, root) for v in views) or (
        f'<p class="muted">DAG {escape(dag_id)} runs no microbatch pipeline: none of its '
        f"tasks produces a {escape('microbatch://<pipeline>')} asset (the batch task of a "
        "DAG declared with microbatch_dag() does).</p>"
    )
    body = f'<p><a href="{root}">all pipelines</a></p>{sections}'
    return document(f"Microbatch · {dag_id}", f"Microbatch · DAG {escape(dag_id)}", body, user)


def error_page(message: str, root: str, user: str | None = None) -> str:
    """What a page could not show, and the way back."""
    back = f'<a href="{escape(root)}">all pipelines</a>'
    body = f'<p class="error">{escape(message)}</p><p>{back}</p>'
    return document("Microbatch", "Microbatch", body, user)
