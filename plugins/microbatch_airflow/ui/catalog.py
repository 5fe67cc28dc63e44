"""Which pipelines the Microbatch page shows, and where their checkpoints are.

The page never loads a job file: job files are user code, and the API server must not run
it. It reads what Airflow already stores about each pipeline instead:

1. **the pipeline's asset** ``microbatch://<pipeline>``, declared by its DAG
   (:func:`microbatch_airflow.dag_factory.microbatch_dag`), so a pipeline is listed as
   soon as the DAG processor has parsed its DAG;
2. **its newest asset event**: the batch task records the checkpoint location and the
   source topics in each committed batch's event ``extra`` (``checkpoints``, ``topics``:
   :func:`microbatch_airflow.assets.asset_event_extra`; the job printed them with its
   result). A pipeline without a committed batch yet is listed without facts;
3. ``[microbatch] pipelines`` (``AIRFLOW__MICROBATCH__PIPELINES``): optional
   ``name=checkpoint_url`` pairs, comma-separated, for pipelines Airflow does not run or
   whose first batch has not committed; an entry overrides what the events say.

A DAG's pipelines (its tab, ``destination: "dag"``) are the ``microbatch://`` assets its
tasks produce (Airflow's ``TaskOutletAssetReference``: ``microbatch_dag``'s batch task has
the pipeline's asset as outlet), so the tab never guesses from the DAG id.

From the checkpoint location the page reads the stored facts with the library's
checkpoint functions (:mod:`microbatch_airflow.ui.data`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

from microbatch_airflow.assets import ASSET_SCHEME


@dataclasses.dataclass(frozen=True)
class PipelineRef:
    """A pipeline as the page knows it: its name, where its checkpoints are (None: not
    known yet), its source topics, and what the page could not make out (``error``)."""

    name: str
    checkpoints: str | None = None
    topics: tuple[str, ...] = ()
    error: str | None = None


def pipeline_of_uri(uri: str) -> str | None:
    """The pipeline of its asset ``microbatch://<pipeline>`` (Airflow stores it with a
    trailing ``/``); None for any other URI, including a pipeline's other assets such as
    ``microbatch://<pipeline>/new-records`` (the event-driven DAG's watched asset), whose
    events do not record checkpoints."""
    prefix = f"{ASSET_SCHEME}://"
    if not uri.startswith(prefix):
        return None
    name = uri[len(prefix) :].rstrip("/")
    return name if name and "/" not in name else None


def refs_from_events(events: Iterable[tuple[str, Mapping[str, Any] | None]]) -> list[PipelineRef]:
    """``(asset uri, newest event extra or None)`` pairs → one ref per pipeline asset,
    named by its asset (what its DAG declared), not by the job's own pipeline name: two
    DAGs may run one job file on different namespaces, each with its own checkpoints."""
    refs = []
    for uri, extra in events:
        from_uri = pipeline_of_uri(uri)
        if from_uri is None:
            continue
        extra = extra or {}
        refs.append(
            PipelineRef(
                name=from_uri,
                checkpoints=extra.get("checkpoints") or None,
                topics=tuple(extra.get("topics") or ()),
            )
        )
    return refs


def refs_from_config(raw: str) -> list[PipelineRef]:
    """``name=checkpoint_url`` pairs; any other entry is shown with its error."""
    refs = []
    for item in (part.strip() for part in raw.split(",")):
        if not item:
            continue
        name, sep, url = (part.strip() for part in item.partition("="))
        if not sep or not name or not url:
            refs.append(
                PipelineRef(
                    name=name or item,
                    error=(
                        f"[microbatch] pipelines entry {item!r} is not name=checkpoint_url "
                        "(the page reads checkpoint locations, it does not load job files)"
                    ),
                )
            )
            continue
        refs.append(PipelineRef(name=name, checkpoints=url))
    return refs


def merge(
    from_events: Iterable[PipelineRef], from_config: Iterable[PipelineRef]
) -> list[PipelineRef]:
    """One ref per name, sorted; a configured location wins over an event's."""
    by_name = {ref.name: ref for ref in from_events}
    for ref in from_config:
        known = by_name.get(ref.name)
        topics = ref.topics or (known.topics if known is not None else ())
        by_name[ref.name] = dataclasses.replace(ref, topics=topics)
    return [by_name[name] for name in sorted(by_name)]


def asset_events(dag_id: str | None = None) -> list[tuple[str, Mapping[str, Any] | None]]:
    """Each active ``microbatch://`` asset (only those a task of ``dag_id`` produces, when
    given) with its newest event's ``extra`` (Airflow's metadata database; the API
    server's own session)."""
    from airflow.models.asset import AssetEvent, AssetModel, TaskOutletAssetReference
    from airflow.utils.session import create_session
    from sqlalchemy import select

    query = (
        select(AssetModel.id, AssetModel.uri)
        .where(AssetModel.uri.like(f"{ASSET_SCHEME}://%"), AssetModel.active.has())
        .order_by(AssetModel.uri)
    )
    if dag_id is not None:
        produced = select(TaskOutletAssetReference.asset_id).where(
            TaskOutletAssetReference.dag_id == dag_id
        )
        query = query.where(AssetModel.id.in_(produced))
    with create_session() as session:
        assets = session.execute(query).all()
        out = []
        for asset_id, uri in assets:
            extra = session.scalar(
                select(AssetEvent.extra)
                .where(AssetEvent.asset_id == asset_id)
                .order_by(AssetEvent.timestamp.desc(), AssetEvent.id.desc())
                .limit(1)
            )
            out.append((uri, extra))
    return out


def configured_pipelines() -> list[PipelineRef]:
    """The page's pipelines: from Airflow's assets and events, and ``[microbatch]
    pipelines``."""
    from airflow.configuration import conf

    raw = conf.get("microbatch", "pipelines", fallback="") or ""
    return merge(refs_from_events(asset_events()), refs_from_config(raw))


def dag_pipelines(dag_id: str) -> list[str] | None:
    """The pipelines DAG ``dag_id`` runs: those whose asset one of its tasks produces,
    named as on the page (the newest event's ``pipeline``, else the asset URI). None when
    Airflow knows no such DAG."""
    from airflow.models.dag import DagModel
    from airflow.utils.session import create_session
    from sqlalchemy import select

    with create_session() as session:
        known = session.scalar(select(DagModel.dag_id).where(DagModel.dag_id == dag_id))
    if known is None:
        return None
    return sorted({ref.name for ref in refs_from_events(asset_events(dag_id))})
