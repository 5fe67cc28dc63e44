"""The example pipeline's entrypoint: clickstream sessionization with profile enrichment.

    microbatch run jobs/clickstream.py [--parallelism 3] [--until ...]   # from the CLI
    spark-submit jobs/clickstream.py [--parallelism 3] [--until ...]     # as a Spark job

Settings come from ``MICROBATCH_*`` variables (``MICROBATCH_CLICKSTREAM_*`` for the
pipeline's topics, root and profile service). The logic lives in
``microbatch.examples.clickstream``.
"""

from __future__ import annotations

import sys

from microbatch.examples.clickstream import ClickstreamConfig, clickstream_pipeline
from microbatch.settings import Settings

pipeline = clickstream_pipeline(ClickstreamConfig.from_env(Settings.from_env().s3_bucket))

if __name__ == "__main__":
    import logging

    from microbatch.cli import exit_now, main

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    exit_now(main(["run", f"{__file__}:pipeline", *sys.argv[1:]]))
