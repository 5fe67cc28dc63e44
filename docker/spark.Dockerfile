# syntax=docker/dockerfile:1
#
# The image of the Spark master and worker in docker-compose.yml: Spark from the lock's
# pyspark (4.2.0; its bundled jars and bin/spark-class run the standalone daemons, as
# `make cluster` does), a Java 17 runtime, and the executors' Python.
#
#   docker build -f docker/spark.Dockerfile -t microbatch-spark:local .
#
# Executors run the jobs' Python (stage 1 decoding, the sinks, ...), so they need what the
# driver has: the same Python minor version (PySpark refuses a worker whose version differs
# from the driver's; the Airflow image is on Python 3.11, like requirements.lock), the same
# libs/microbatch and the same package versions. Also libs/microbatch-dev: the compose
# stack runs the example pipeline, whose functions (microbatch.examples.clickstream) the
# executors import; executors of your own pipelines need libs/microbatch only. Hence this base (the official Python
# 3.11 image, pinned to a patch release) rather than apache/spark's images, whose Python is
# whatever their Ubuntu ships, and the whole lock rather than a hand-picked subset: an
# import missing on the executors would only show when a batch runs.

FROM python:3.11.14-slim-bookworm

# The same uv as `make venv` (Makefile: UV_VERSION).
ARG UV_VERSION=0.13.9

# The same Java runtime as the Airflow image (where the driver runs), from the same pinned
# Eclipse Temurin image.
COPY --from=eclipse-temurin:17.0.17_10-jre /opt/java/openjdk /opt/java/openjdk

# Spark's conventional unprivileged user (uid 185, as in apache/spark's images).
RUN useradd --uid 185 --no-create-home --home-dir /opt/spark-work --shell /usr/sbin/nologin spark \
    && mkdir -p /opt/spark-work \
    && chown spark /opt/spark-work

COPY requirements.lock /opt/microbatch/requirements.lock
COPY libs/microbatch /opt/microbatch/libs/microbatch
COPY libs/microbatch-dev /opt/microbatch/libs/microbatch-dev

# Exactly the lock (as `make venv` builds .venv) plus the library and the examples (their
# dependencies are all in the lock), at build time.
RUN python3 -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' \
    && python3 -m venv /opt/microbatch/venv \
    && /opt/microbatch/venv/bin/python -m pip install --no-cache-dir --disable-pip-version-check \
        "uv==${UV_VERSION}" \
    && /opt/microbatch/venv/bin/uv pip install --no-cache --compile-bytecode \
        --python /opt/microbatch/venv/bin/python \
        -r /opt/microbatch/requirements.lock \
        /opt/microbatch/libs/microbatch \
        /opt/microbatch/libs/microbatch-dev \
    && /opt/microbatch/venv/bin/uv pip check --python /opt/microbatch/venv/bin/python

# The environment's bin/ first: `python3` (what PYSPARK_PYTHON=python3 from the driver
# names) is Python 3.11 with the lock's packages; `spark-class` is pyspark's.
# SPARK_WORKER_DIR: applications' work folders (the default, under pyspark's package
# folder, is not writable by the spark user).
ENV VIRTUAL_ENV=/opt/microbatch/venv \
    JAVA_HOME=/opt/java/openjdk \
    PATH="/opt/microbatch/venv/bin:/opt/java/openjdk/bin:${PATH}" \
    PYSPARK_PYTHON=python3 \
    SPARK_WORKER_DIR=/opt/spark-work

USER spark
WORKDIR /opt/spark-work

# Fail the build, not the first batch, if the runtime is incomplete.
RUN java -version \
    && spark-class org.apache.spark.deploy.master.Master --help 2>&1 | grep -q -- --webui-port \
    && python3 -c 'import microbatch, microbatch.examples.clickstream, pyspark, pyarrow, pandas'

CMD ["spark-class", "org.apache.spark.deploy.master.Master"]
