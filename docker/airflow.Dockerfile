# syntax=docker/dockerfile:1
#
# The image of every Airflow service in docker-compose.yml (api-server, scheduler,
# dag-processor, triggerer, and the one-shot airflow-init). The scheduler runs the tasks
# (LocalExecutor), so spark-submit runs here: the image carries a Java runtime, the Python
# packages of requirements.lock, libs/microbatch, libs/microbatch-dev and Spark's
# Kafka/Delta connector jars, all fixed at build time. Nothing is installed when a
# container starts.
#
# libs/microbatch-dev (the local stack, the demo and the examples, outside the runtime
# wheel) is here because this stack runs the example: the clickstream DAG's job imports
# microbatch.examples.clickstream, and the `jars` stage resolves the connector jars with
# microbatch.localstack. An image for your own pipelines needs libs/microbatch only (and
# the jars resolved some other way, or `--packages`).
#
#   docker build -f docker/airflow.Dockerfile -t microbatch-airflow:local .
#
# Base: the official Airflow image of the lock's apache-airflow (3.3.2) on Python 3.11,
# the Python of requirements.lock (`uv pip compile --python-version 3.11`) and of the Spark
# image (docker/spark.Dockerfile): PySpark refuses Python workers whose minor version
# differs from the driver's. We use its OS, its Python build, its `airflow` user, folders
# and entrypoint; not its Python packages (see the `env` stage).

# --- env: the Python environment, built from the lock alone ----------------------------
FROM apache/airflow:3.3.2-python3.11 AS env

# The same uv as `make venv` (Makefile: UV_VERSION).
ARG UV_VERSION=0.13.9

# Why a fresh environment instead of installing the lock on top of the image's:
# the image's environment (the virtualenv at /home/airflow/.local) holds Airflow with the
# reference image's thirty-odd extras (amazon, celery, google, postgres, ...), resolved
# against Airflow's own constraints file. requirements.lock is a different resolution of apache-airflow==3.3.2: it pins the
# same packages Airflow needs (sqlalchemy, pydantic, fastapi, ...) at possibly other
# versions, plus pyspark, boto3, pyarrow, ... Installing it over the image's environment
# would move those shared packages under providers that were never resolved with them, and
# pip would only warn. So the environment is replaced, at the same path, by one holding
# exactly the lock (as `make venv` builds .venv): every version is the lock's, the
# resolution is uv's for the whole set, and `uv pip check` below fails the build if
# anything does not fit. Airflow itself comes from the lock too (apache-airflow==3.3.2,
# the image's own version), so the image's entrypoint and CLI keep working.
#
# The one package not from the lock: psycopg2-binary, the PostgreSQL driver of the
# metadata database (`postgresql+psycopg2://` in docker-compose.yml). The lock has none
# (the local stack uses SQLite) and it has no dependencies, so it cannot move a pin.
ARG PSYCOPG2_VERSION=2.9.13

USER root
RUN rm -rf /home/airflow/.local \
    && mkdir -p /opt/microbatch/.local \
    && chown -R airflow:root /home/airflow /opt/microbatch
USER airflow

COPY --chown=airflow:root requirements.lock /opt/microbatch/requirements.lock
COPY --chown=airflow:root libs/microbatch /opt/microbatch/libs/microbatch
COPY --chown=airflow:root libs/microbatch-dev /opt/microbatch/libs/microbatch-dev
# The Airflow provider (plugins/pyproject.toml): its entry points register the plugin, the
# connection types and the [microbatch] config. Installed as a package like the library;
# the compose stack also mounts plugins/ as the plugins folder, whose scan skips it
# (plugins/.airflowignore), so the plugin is registered once.
COPY --chown=airflow:root plugins /opt/microbatch/providers/microbatch-airflow

# `python3` is now the image's own interpreter (its virtualenv is gone), Python 3.11.
# The library is installed as a package, not editable: executors (Spark image) and driver
# (here) run the same files, both from this build's libs/microbatch and libs/microbatch-dev
# (whose dependencies are all in the lock: it adds no package).
RUN python3 -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' \
    && python3 -m venv /home/airflow/.local \
    && PIP_USER=0 /home/airflow/.local/bin/python -m pip install --no-cache-dir \
        --disable-pip-version-check "uv==${UV_VERSION}" \
    && /home/airflow/.local/bin/uv pip install --no-cache --compile-bytecode \
        --python /home/airflow/.local/bin/python \
        -r /opt/microbatch/requirements.lock \
        /opt/microbatch/libs/microbatch \
        /opt/microbatch/libs/microbatch-dev \
        /opt/microbatch/providers/microbatch-airflow \
        "psycopg2-binary==${PSYCOPG2_VERSION}" \
    && /home/airflow/.local/bin/uv pip check --python /home/airflow/.local/bin/python

# --- jars: Spark's Kafka connector and Delta Lake for Spark, from Maven Central ---------
# What `make jars` does, with Maven present in this stage only. The library resolves them
# for the installed pyspark (4.2.0, the lock's) into $MICROBATCH_HOME; spark-submit gets
# the Kafka connector with --jars (microbatch.submit), so the Spark image needs none.
# The Kafka broker's jars (also fetched by `make jars`) are not needed: Kafka runs in its
# own container.
FROM env AS jars
USER root
RUN apt-get update \
    && apt-get install -y --no-install-recommends maven \
    && rm -rf /var/lib/apt/lists/*
USER airflow
ENV MICROBATCH_HOME=/opt/microbatch/.local
RUN /home/airflow/.local/bin/python -c 'from microbatch.localstack.spark_kafka import ensure_spark_kafka_jars; from microbatch.settings import Settings; print(ensure_spark_kafka_jars(Settings.from_env().home_path)[0].parent)' \
    && /home/airflow/.local/bin/python -c 'from microbatch.localstack.delta_jars import ensure_delta_jars; from microbatch.settings import Settings; print(ensure_delta_jars(Settings.from_env().home_path)[0].parent)'

# --- the image ---------------------------------------------------------------------------
FROM apache/airflow:3.3.2-python3.11

USER root
# A Java 17 runtime for spark-submit (pyspark's driver JVM), copied from a pinned
# Eclipse Temurin image: the very same JRE as in the Spark image, whatever Debian
# release the Airflow base image is built on (an apt package's name and version would
# follow that release).
COPY --from=eclipse-temurin:17.0.17_10-jre /opt/java/openjdk /opt/java/openjdk
# Replace the base image's Python environment (removed first: COPY would merge into it).
RUN rm -rf /home/airflow/.local
COPY --from=env --chown=airflow:root /home/airflow/.local /home/airflow/.local
COPY --from=jars --chown=airflow:root /opt/microbatch /opt/microbatch

# The environment's bin/ first (the base image has it first too; spelled out here):
# `airflow`, `spark-submit` and `python3` are the lock's. PYSPARK_PYTHON is what the driver
# tells executors to run: `python3`, found on each side's PATH (in the Spark image, its own
# environment), both Python 3.11; an absolute path of this image would not exist there.
ENV VIRTUAL_ENV=/home/airflow/.local \
    JAVA_HOME=/opt/java/openjdk \
    PATH="/home/airflow/.local/bin:/opt/java/openjdk/bin:${PATH}" \
    PYSPARK_PYTHON=python3 \
    MICROBATCH_HOME=/opt/microbatch/.local

USER airflow
# Fail the build, not the first task, if the runtime is incomplete.
RUN java -version \
    && spark-submit --version \
    && python -c 'import airflow, microbatch, microbatch.examples.clickstream, microbatch_airflow, psycopg2, pyspark'
