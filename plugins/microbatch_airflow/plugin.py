"""The Airflow plugin: the Microbatch page (a FastAPI app) and its link in the nav bar."""

from __future__ import annotations

from airflow.plugins_manager import AirflowPlugin

from microbatch_airflow.ui.app import URL_PREFIX, create_app


class MicrobatchPlugin(AirflowPlugin):
    name = "microbatch"
    fastapi_apps = [  # noqa: RUF012 (Airflow reads these class attributes)
        {"app": create_app(), "url_prefix": URL_PREFIX, "name": "Microbatch pipelines"}
    ]
    external_views = [  # noqa: RUF012
        {
            "name": "Microbatch",
            "href": URL_PREFIX.lstrip("/") + "/",
            "url_route": "microbatch",
            "destination": "nav",
            "category": "browse",
        }
    ]
