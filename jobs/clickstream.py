"""The example pipeline's entrypoint: clickstream sessionization with profile enrichment.

    microbatch run jobs/clickstream.py [--parallelism 3] [--until ...]   # from the CLI
    spark-submit jobs/clickstream.py [--parallelism 3] [--until ...]     # as a Spark job

:func:`pipeline` builds the pipeline when its caller asks, never at import (the job-file
convention of ``microbatch.jobfile``): the bucket comes from the caller's settings
(``MICROBATCH_*`` variables or the Airflow connections), the pipeline's topics, root and
profile service from ``MICROBATCH_CLICKSTREAM_*`` in its environment. The logic lives in
``microbatch.examples.clickstream``.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping

from microbatch.examples.clickstream import ClickstreamConfig, clickstream_pipeline
from microbatch.runtime import Pipeline
from microbatch.settings import Settings


def pipeline(settings: Settings, env: Mapping[str, str]) -> Pipeline:
    """The clickstream pipeline configured by ``settings`` and ``env``."""
    return clickstream_pipeline(ClickstreamConfig.from_env(settings.s3_bucket, env))


if __name__ == "__main__":
    import logging

    from microbatch.cli import exit_now, main

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    exit_now(main(["run", f"{__file__}:pipeline", *sys.argv[1:]]))
