"""The pipeline ``bench_spark_modes.py`` runs: the example's sessionization without enrichment.

Clicks from Kafka → keyed by user → sessions closed by event-time timers → Parquet and a
Kafka topic, malformed clicks to a dead-letter topic: the clickstream pipeline
(``microbatch.examples.clickstream``) minus its HTTP profile lookup, whose latency would
otherwise hide the engine's own per-batch cost. Configured like the example, when
:func:`pipeline` is called, by ``MICROBATCH_CLICKSTREAM_*`` variables (topic, sinks'
topics, root).

    spark-submit bench/spark_modes_job.py [--parallelism 2] [--run-id ...]
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Mapping

from microbatch.examples.clickstream import ClickstreamConfig, clickstream_pipeline
from microbatch.runtime import Pipeline
from microbatch.settings import Settings


def pipeline(settings: Settings, env: Mapping[str, str]) -> Pipeline:
    """The example's pipeline for ``settings`` and ``env``, renamed, without enrichment."""
    config = ClickstreamConfig.from_env(settings.s3_bucket, env)
    return dataclasses.replace(clickstream_pipeline(config), name="bench-sessions", enrich=None)


if __name__ == "__main__":
    from microbatch.cli import exit_now, main

    exit_now(main(["run", f"{__file__}:pipeline", *sys.argv[1:]]))
