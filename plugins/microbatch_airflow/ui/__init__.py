"""The "Microbatch" page in the Airflow UI: pipelines, checkpoints, lag, state size.

``data`` reads a pipeline's checkpoints and Kafka offsets into plain dicts, ``render``
turns them into one HTML page (inline SVG, no JavaScript, nothing from the internet),
``app`` is the FastAPI app the plugin mounts, with Airflow's login enforced.
"""
