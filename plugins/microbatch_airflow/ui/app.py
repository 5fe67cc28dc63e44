"""The FastAPI app of the Microbatch page, with Airflow's login enforced by the app itself.

Airflow mounts plugin apps with ``app.mount()`` and authenticates none of their routes:
its core API's auth dependency does not reach a mounted app. So every route here depends
on :func:`airflow_user`, which applies Airflow's own rule (``get_user`` of the core API:
the ``Authorization: Bearer <JWT>`` header, else the ``_token`` session cookie the Airflow
UI sets at login, validated by the configured auth manager), then asks the auth manager
whether that user may see the website. No credential → 401 (or, for a browser, a redirect
to Airflow's login page); a bad or expired token → 401/403.

The pipelines and their checkpoint locations come from Airflow's own records (each
pipeline's asset and its newest event; ``[microbatch] pipelines`` adds or overrides
``name=checkpoint_url`` pairs): :mod:`microbatch_airflow.ui.catalog`. The page never loads
a job file, so no pipeline code runs in the API server.

Routes (each HTML page has a JSON twin under ``/api``):

- ``/`` — every pipeline (the nav view); ``/api/pipelines``;
- ``/dags/<dag_id>`` — the pipelines a DAG runs (the DAG's tab); ``/api/dags/<dag_id>``;
- ``/pipelines/<name>/checkpoints/<id>`` — one checkpoint in detail;
  ``/api/pipelines/<name>/checkpoints/<id>``.

An unknown DAG, pipeline or checkpoint is a 404 whose message names it; a store that
cannot be read is a 502.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse

from microbatch_airflow.ui.catalog import PipelineRef, configured_pipelines, dag_pipelines
from microbatch_airflow.ui.checkpoint import (
    NotFound,
    PageError,
    Unreadable,
    checkpoint_view,
    parse_checkpoint_id,
)
from microbatch_airflow.ui.data import kafka_end_offsets, pipeline_view
from microbatch_airflow.ui.render import dag_page, error_page, page
from microbatch_airflow.ui.render_checkpoint import ROOT as CHECKPOINT_ROOT
from microbatch_airflow.ui.render_checkpoint import checkpoint_page

URL_PREFIX = "/microbatch"
# Airflow's session cookie (base_auth_manager.COOKIE_NAME_JWT_TOKEN), named here so a
# request without any credential is refused without importing Airflow's core.
SESSION_COOKIE = "_token"


class LoginRequired(Exception):
    """No Airflow credential on a browser request: send the user to the login page."""

    def __init__(self, next_url: str) -> None:
        super().__init__(next_url)
        self.next_url = next_url


async def airflow_user(request: Request) -> Any:
    """The Airflow user behind the request, or an HTTP error (see the module docstring)."""
    header = request.headers.get("authorization", "")
    has_bearer = header.lower().startswith("bearer ")
    if not has_bearer and not request.cookies.get(SESSION_COOKIE):
        if "text/html" in request.headers.get("accept", ""):
            raise LoginRequired(str(request.url))
        raise HTTPException(
            status_code=401,
            detail="Not authenticated: log in to Airflow (or send an Airflow JWT as Bearer)",
            headers={"WWW-Authenticate": "Bearer"},
        )
    from airflow.api_fastapi.app import get_auth_manager
    from airflow.api_fastapi.auth.managers.models.resource_details import AccessView
    from airflow.api_fastapi.core_api.security import get_user
    from fastapi.security import HTTPAuthorizationCredentials

    credentials = (
        HTTPAuthorizationCredentials(scheme="Bearer", credentials=header.split(" ", 1)[1].strip())
        if has_bearer
        else None
    )
    user = await get_user(request, None, credentials)
    if not get_auth_manager().is_authorized_view(access_view=AccessView.WEBSITE, user=user):
        raise HTTPException(status_code=403, detail="Forbidden")
    return user


def _default_settings() -> Any:
    from microbatch_airflow.connections import settings_from_airflow

    return settings_from_airflow()


def collect(refs: Sequence[PipelineRef], settings: Any, end_offsets: Any) -> list[dict[str, Any]]:
    """One view per pipeline; a pipeline that cannot be read shows its error instead."""
    views = []
    for ref in refs:
        base = {
            "name": ref.name,
            "checkpoints_url": ref.checkpoints or "",
            "topics": list(ref.topics),
            "latest": None,
        }
        if ref.error is not None:
            views.append(base | {"errors": [ref.error]})
            continue
        if ref.checkpoints is None:
            views.append(base | {"errors": [], "note": "no committed batch yet"})
            continue
        try:
            views.append(
                pipeline_view(ref.name, ref.checkpoints, settings, end_offsets, ref.topics)
            )
        except Exception as exc:
            views.append(base | {"errors": [f"cannot read checkpoints: {str(exc)[:500]}"]})
    return views


def find_pipeline(refs: Sequence[PipelineRef], name: str) -> PipelineRef:
    """The pipeline called ``name``, or ``NotFound`` saying where pipelines come from."""
    for ref in refs:
        if ref.name == name:
            return ref
    raise NotFound(
        f"no pipeline {name!r}: no DAG produces the asset microbatch://{name} and "
        "[microbatch] pipelines does not name it. Check the name against the Microbatch page."
    )


def read_checkpoint(ref: PipelineRef, raw_id: str, settings: Any) -> dict[str, Any]:
    """The drill-down view of checkpoint ``raw_id`` (a URL segment) of ``ref``."""
    checkpoint_id = parse_checkpoint_id(ref.name, raw_id)
    if ref.error is not None:
        raise NotFound(f"pipeline {ref.name!r}: {ref.error}")
    if ref.checkpoints is None:
        raise NotFound(
            f"pipeline {ref.name!r} has no committed batch yet, so no checkpoint "
            f"{checkpoint_id}: run its DAG (or set [microbatch] pipelines to its "
            "checkpoint location)"
        )
    try:
        return checkpoint_view(ref.name, ref.checkpoints, checkpoint_id, settings)
    except PageError:
        raise
    except Exception as exc:
        raise Unreadable(
            f"cannot read checkpoint {checkpoint_id} of pipeline {ref.name!r} at "
            f"{ref.checkpoints}: {str(exc)[:500]}. Check the API server's S3 settings "
            "(the microbatch_s3 connection or MICROBATCH_S3_*) and that the store is up."
        ) from exc


def create_app(
    pipelines: Callable[[], Sequence[PipelineRef]] = configured_pipelines,
    *,
    authenticate: Callable[[Request], Awaitable[Any]] = airflow_user,
    settings: Callable[[], Any] = _default_settings,
    end_offsets: Callable[[Any], Any] = kafka_end_offsets,
    dag_pipeline_names: Callable[[str], Sequence[str] | None] = dag_pipelines,
) -> FastAPI:
    """The app; the keyword arguments exist so tests can run it without an API server."""
    app = FastAPI(title="Microbatch", docs_url=None, redoc_url=None, openapi_url=None)
    signed_in = Depends(authenticate)  # every route needs an Airflow user

    @app.exception_handler(LoginRequired)
    async def to_login(request: Request, exc: LoginRequired) -> Any:
        try:
            from airflow.api_fastapi.app import get_auth_manager

            return RedirectResponse(get_auth_manager().get_url_login(next_url=exc.next_url))
        except Exception:  # no auth manager (outside the API server)
            return JSONResponse({"detail": "Not authenticated: log in to Airflow"}, 401)

    def views() -> list[dict[str, Any]]:
        s = settings()
        return collect(pipelines(), s, end_offsets(s))

    def dag_views(dag_id: str) -> list[dict[str, Any]]:
        names = dag_pipeline_names(dag_id)
        if names is None:
            raise NotFound(
                f"Airflow knows no DAG {dag_id!r}: check the DAG id (a DAG is known once "
                "the DAG processor has parsed its file)"
            )
        known = {ref.name: ref for ref in pipelines()}
        s = settings()
        return collect([known.get(n, PipelineRef(n)) for n in names], s, end_offsets(s))

    def checkpoint(name: str, raw_id: str) -> dict[str, Any]:
        return read_checkpoint(find_pipeline(pipelines(), name), raw_id, settings())

    @app.get("/", response_class=HTMLResponse)
    def index(user: Any = signed_in) -> HTMLResponse:
        return HTMLResponse(page(views(), user=user_name(user)))

    @app.get("/api/pipelines")
    def pipelines_json(user: Any = signed_in) -> list[dict[str, Any]]:
        return views()

    @app.get("/dags/{dag_id}", response_class=HTMLResponse)
    def dag_tab(dag_id: str, user: Any = signed_in) -> HTMLResponse:
        who = user_name(user)
        return html(lambda: dag_page(dag_id, dag_views(dag_id), who), "../", who)

    @app.get("/api/dags/{dag_id}")
    def dag_json(dag_id: str, user: Any = signed_in) -> dict[str, Any]:
        return {"dag_id": dag_id, "pipelines": as_json(lambda: dag_views(dag_id))}

    @app.get("/pipelines/{name}/checkpoints/{checkpoint_id}", response_class=HTMLResponse)
    def checkpoint_html(name: str, checkpoint_id: str, user: Any = signed_in) -> HTMLResponse:
        who = user_name(user)
        return html(
            lambda: checkpoint_page(checkpoint(name, checkpoint_id), who), CHECKPOINT_ROOT, who
        )

    @app.get("/api/pipelines/{name}/checkpoints/{checkpoint_id}")
    def checkpoint_json(name: str, checkpoint_id: str, user: Any = signed_in) -> dict[str, Any]:
        return as_json(lambda: checkpoint(name, checkpoint_id))

    return app


def user_name(user: Any) -> str | None:
    """Whom the page greets (tests authenticate with a plain string, no user object)."""
    return getattr(user, "get_name", lambda: None)() if user is not None else None


def html(render: Callable[[], str], root: str, user: str | None) -> HTMLResponse:
    """The rendered page, or an error page with the message and its status."""
    try:
        return HTMLResponse(render())
    except PageError as exc:
        return HTMLResponse(error_page(str(exc), root, user), status_code=exc.status)


def as_json(read: Callable[[], Any]) -> Any:
    """What ``read`` returns, or the error as ``{"detail": message}`` with its status."""
    try:
        return read()
    except PageError as exc:
        raise HTTPException(status_code=exc.status, detail=str(exc)) from None
