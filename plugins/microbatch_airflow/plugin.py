"""The Airflow plugin: the Microbatch page (a FastAPI app), its link in the nav bar and a
tab on every DAG's page.

Airflow's UI shows an external view in an iframe: a ``"nav"`` view at
``<airflow>/plugin/<url_route>``, a ``"dag"`` view as a tab at
``<airflow>/dags/<dag_id>/plugin/<url_route>``, where the UI replaces ``{DAG_ID}`` in its
``href`` (URL-encoded) before loading it. A relative ``href`` resolves against the UI's
``<base href>``, Airflow's base URL, which is where the app is mounted too. Each
``url_route`` must be unique among all plugins' views.
"""

from __future__ import annotations

from airflow.plugins_manager import AirflowPlugin

from microbatch_airflow.ui.app import URL_PREFIX, create_app

APP_HREF = URL_PREFIX.lstrip("/") + "/"


class MicrobatchPlugin(AirflowPlugin):
    name = "microbatch"
    fastapi_apps = [  # noqa: RUF012 (Airflow reads these class attributes)
        {"app": create_app(), "url_prefix": URL_PREFIX, "name": "Microbatch pipelines"}
    ]
    external_views = [  # noqa: RUF012
        {
            "name": "Microbatch",
            "href": APP_HREF,
            "url_route": "microbatch",
            "destination": "nav",
            "category": "browse",
        },
        {  # the pipelines this DAG runs (a DAG without any says so)
            "name": "Microbatch",
            "href": APP_HREF + "dags/{DAG_ID}",
            "url_route": "microbatch-dag",
            "destination": "dag",
        },
    ]
