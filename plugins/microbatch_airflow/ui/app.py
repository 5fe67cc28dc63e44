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
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse

from microbatch_airflow.ui.catalog import PipelineRef, configured_pipelines
from microbatch_airflow.ui.data import kafka_end_offsets, pipeline_view
from microbatch_airflow.ui.render import page

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


def create_app(
    pipelines: Callable[[], Sequence[PipelineRef]] = configured_pipelines,
    *,
    authenticate: Callable[[Request], Awaitable[Any]] = airflow_user,
    settings: Callable[[], Any] = _default_settings,
    end_offsets: Callable[[Any], Any] = kafka_end_offsets,
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

    @app.get("/", response_class=HTMLResponse)
    def index(user: Any = signed_in) -> HTMLResponse:
        name = getattr(user, "get_name", lambda: None)() if user is not None else None
        return HTMLResponse(page(views(), user=name))

    @app.get("/api/pipelines")
    def pipelines_json(user: Any = signed_in) -> list[dict[str, Any]]:
        return views()

    return app
