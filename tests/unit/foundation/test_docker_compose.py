"""docker-compose.yml and the images it builds (docker/*.Dockerfile) cannot run here (no
Docker engine), so their structure is pinned down by reading the files: what each service
runs, which images are built or pulled and how they are pinned, and what the Dockerfiles
install. Nothing here builds an image or starts a container."""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

from microbatch import Settings

ROOT = Path(__file__).resolve().parents[3]
COMPOSE = ROOT / "docker-compose.yml"
LOCK = ROOT / "requirements.lock"
AIRFLOW_SERVICES = [
    "airflow-apiserver",
    "airflow-scheduler",
    "airflow-dag-processor",
    "airflow-triggerer",
]
SPARK_SERVICES = ["spark-master", "spark-worker"]
#: The Airflow service that runs tasks, hence spark-submit (LocalExecutor).
SPARK_SUBMIT_SERVICE = "airflow-scheduler"


# --- reading a Dockerfile ----------------------------------------------------------------


@dataclass
class Stage:
    base: str
    name: str | None
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def args(self, keyword: str) -> list[str]:
        return [args for kw, args in self.instructions if kw == keyword]

    def env(self) -> dict[str, str]:
        """The stage's ENV values (``KEY=value`` form), later ones winning."""
        values: dict[str, str] = {}
        for args in self.args("ENV"):
            for token in shlex.split(args):
                key, sep, value = token.partition("=")
                assert sep, f"ENV {args!r}: use the KEY=value form"
                values[key] = value
        return values

    def build_args(self) -> dict[str, str]:
        """The stage's ``ARG NAME=default`` values."""
        return dict(a.partition("=")[::2] for a in self.args("ARG") if "=" in a)

    def runs(self) -> str:
        """The stage's RUN commands, its build arguments replaced by their defaults."""
        text = "\n".join(self.args("RUN"))
        for name, value in self.build_args().items():
            text = text.replace(f"${{{name}}}", value).replace(f"${name}", value)
        return text


@dataclass
class Dockerfile:
    path: Path
    stages: list[Stage]

    @property
    def final(self) -> Stage:
        return self.stages[-1]

    def external_images(self) -> list[str]:
        """Every image this file pulls: ``FROM`` bases and ``COPY --from`` sources that are
        not stages of the file itself."""
        names = {s.name for s in self.stages if s.name}
        images = [s.base for s in self.stages]
        for stage in self.stages:
            for args in stage.args("COPY"):
                found = re.search(r"--from=(\S+)", args)
                if found:
                    images.append(found.group(1))
        return [image for image in images if image not in names]


def parse_dockerfile(path: Path) -> Dockerfile:
    """Instructions grouped by stage: comments dropped, continuation lines joined."""
    instructions: list[tuple[str, str]] = []
    pending = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        pending += line[:-1] + " " if line.endswith("\\") else line
        if line.endswith("\\"):
            continue
        keyword, _, args = pending.partition(" ")
        instructions.append((keyword.upper(), args.strip()))
        pending = ""
    stages: list[Stage] = []
    for keyword, args in instructions:
        if keyword == "FROM":
            parts = args.split()
            name = parts[2] if len(parts) == 3 and parts[1].upper() == "AS" else None
            stages.append(Stage(parts[0], name))
        elif stages:
            stages[-1].instructions.append((keyword, args))
    assert stages, f"{path} has no FROM"
    return Dockerfile(path, stages)


def copy_paths(args: str) -> tuple[list[str], str]:
    """A COPY's sources and destination, its ``--flags`` left out."""
    paths = [token for token in args.split() if not token.startswith("--")]
    return paths[:-1], paths[-1]


def python_minor(image: str) -> str | None:
    """The Python minor version an image reference names: ``python:3.11.14-slim-bookworm``
    and ``apache/airflow:3.3.2-python3.11`` both give ``3.11``."""
    repo, _, tag = image.partition(":")
    if repo.endswith("python"):
        found = re.match(r"(\d+\.\d+)", tag)
    else:
        found = re.search(r"python(\d+\.\d+)", tag)
    return found.group(1) if found else None


def java_runtime(stage: Stage) -> str | None:
    """Where a stage's Java comes from: a ``COPY --from=eclipse-temurin:...`` image, or an
    ``openjdk-NN`` package apt-get installs; None without one."""
    for args in stage.args("COPY"):
        found = re.search(r"--from=(eclipse-temurin:\S+)", args)
        if found:
            return found.group(1)
    found = re.search(
        r"apt-get install[^&;]*\b(openjdk-\d+-(?:jre|jdk)(?:-headless)?)", stage.runs()
    )
    return found.group(1) if found else None


def java_major(runtime: str) -> int:
    found = re.search(r"(?:temurin:|openjdk-)(\d+)", runtime)
    assert found, f"cannot tell the Java version of {runtime!r}"
    return int(found.group(1))


def pinned(image: str) -> bool:
    """A version tag (at least ``X.Y``), optionally a digest; never ``latest``."""
    name = image.split("@")[0]
    tag = name.rpartition(":")[2] if ":" in name.rpartition("/")[2] else ""
    return "latest" not in tag and bool(re.search(r"\d+\.\d+", tag))


# --- fixtures ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


@pytest.fixture(scope="module")
def lock() -> dict[str, str]:
    pins = {}
    for line in LOCK.read_text().splitlines():
        found = re.match(r"([A-Za-z0-9._-]+)==(\S+)", line)
        if found:
            pins[found.group(1).lower().replace("_", "-")] = found.group(2)
    return pins


@pytest.fixture(scope="module")
def lock_python() -> str:
    found = re.search(r"--python-version (\d+\.\d+)", LOCK.read_text())
    assert found, "requirements.lock's header does not name the Python it was compiled for"
    return found.group(1)


def built_dockerfile(service: dict) -> Path | None:
    build = service.get("build")
    if build is None:
        return None
    if isinstance(build, str):
        build = {"context": build}
    return (ROOT / build.get("context", ".") / build.get("dockerfile", "Dockerfile")).resolve()


@pytest.fixture(scope="module")
def airflow_image(compose) -> Dockerfile:
    path = built_dockerfile(compose["services"][SPARK_SUBMIT_SERVICE])
    assert path is not None, f"{SPARK_SUBMIT_SERVICE} is not built from a Dockerfile"
    return parse_dockerfile(path)


@pytest.fixture(scope="module")
def spark_image(compose) -> Dockerfile:
    path = built_dockerfile(compose["services"]["spark-worker"])
    assert path is not None, "spark-worker is not built from a Dockerfile"
    return parse_dockerfile(path)


# --- the services --------------------------------------------------------------------------


def test_compose_has_every_service_of_the_stack(compose):
    expected = {"kafka", "s3", "postgres", "airflow-init", *SPARK_SERVICES, *AIRFLOW_SERVICES}

    missing = expected - set(compose["services"])
    assert not missing, f"docker-compose.yml lacks the services {sorted(missing)}"


def test_every_service_image_is_pinned_or_built_from_a_repo_dockerfile(compose):
    for name, service in compose["services"].items():
        dockerfile = built_dockerfile(service)
        if dockerfile is None:
            image = service.get("image", "")
            assert pinned(image), f"service {name} pulls {image!r}, not pinned to a version"
            continue
        assert dockerfile.is_relative_to(ROOT), (
            f"service {name} builds {dockerfile}, outside the repo"
        )
        assert dockerfile.is_file(), (
            f"service {name} builds from {dockerfile}, which does not exist"
        )
        assert service.get("image"), f"service {name} builds an image but does not name it"


def test_every_dockerfile_pulls_only_pinned_images():
    dockerfiles = sorted((ROOT / "docker").glob("*.Dockerfile"))
    assert dockerfiles, "no docker/*.Dockerfile"
    for path in dockerfiles:
        for image in parse_dockerfile(path).external_images():
            assert "$" not in image, (
                f"{path.name} pulls {image!r}: a build argument cannot be checked"
            )
            assert pinned(image), f"{path.name} pulls {image!r}, not pinned to a version tag"


def test_airflow_services_run_one_image_built_here(compose):
    services = ["airflow-init", *AIRFLOW_SERVICES]
    builds = {
        name: (built_dockerfile(compose["services"][name]), compose["services"][name]["image"])
        for name in services
    }

    assert len(set(builds.values())) == 1, f"the Airflow services do not share one image: {builds}"
    assert builds[SPARK_SUBMIT_SERVICE][0] is not None, (
        "the Airflow image is not built from the repo"
    )


def test_airflow_is_3_3_on_postgres_with_the_repo_folders_mounted(compose, airflow_image, lock):
    airflow = lock["apache-airflow"]
    for name in AIRFLOW_SERVICES:
        service = compose["services"][name]
        env = service["environment"]
        mounts = {volume.split(":")[1] for volume in service["volumes"]}
        assert env["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"].startswith("postgresql"), name
        assert {
            "/opt/microbatch/dags",
            "/opt/microbatch/plugins",
            "/opt/microbatch/jobs",
        } <= mounts, f"service {name} does not mount dags/, plugins/ and jobs/"
        assert not any(m.startswith("/opt/microbatch/libs") for m in mounts), (
            f"service {name} mounts libs/, but the image has the library installed (not editable): "
            "the mount would change nothing and hide that the image must be rebuilt"
        )
    assert airflow.startswith("3.3."), f"requirements.lock pins apache-airflow {airflow}"
    for stage in airflow_image.stages:
        if stage.base.startswith("apache/airflow:"):
            assert stage.base.startswith(f"apache/airflow:{airflow}-"), (
                f"{airflow_image.path.name} builds on {stage.base}, "
                f"the lock pins apache-airflow=={airflow}"
            )
    assert airflow_image.final.base.startswith("apache/airflow:"), (
        "the Airflow image is not the official one"
    )
    assert "8080:8080" in compose["services"]["airflow-apiserver"]["ports"]


def test_airflow_services_share_one_jwt_secret_and_wait_for_the_migration(compose):
    secrets = {
        compose["services"][name]["environment"].get("AIRFLOW__API_AUTH__JWT_SECRET")
        for name in AIRFLOW_SERVICES
    }
    assert len(secrets) == 1 and None not in secrets, (
        "the Airflow services need one AIRFLOW__API_AUTH__JWT_SECRET (the tasks' tokens), "
        f"found {secrets}"
    )
    for name in AIRFLOW_SERVICES:
        init = compose["services"][name]["depends_on"].get("airflow-init", {})
        assert init.get("condition") == "service_completed_successfully", (
            f"service {name} does not wait for airflow-init's `db migrate` to finish"
        )
    init = compose["services"]["airflow-init"]
    assert init["command"] == ["db", "migrate"], "airflow-init does not run `airflow db migrate`"
    assert "airflow-init" not in init.get("depends_on", {}), "airflow-init depends on itself"


def test_kafka_runs_kraft_with_transactions_on_one_node(compose):
    env = compose["services"]["kafka"]["environment"]

    assert compose["services"]["kafka"]["image"].startswith("apache/kafka:4.1")
    assert env["KAFKA_PROCESS_ROLES"] == "broker,controller"
    assert env["KAFKA_TRANSACTION_STATE_LOG_REPLICATION_FACTOR"] == 1
    assert "9092:9092" in compose["services"]["kafka"]["ports"]


def test_spark_worker_joins_the_master_with_pysparks_spark_class(compose, spark_image):
    worker = compose["services"]["spark-worker"]["command"]

    assert "org.apache.spark.deploy.worker.Worker" in worker
    assert "spark://spark-master:7077" in worker
    for name in SPARK_SERVICES:
        command = compose["services"][name]["command"]
        assert command[0] == "spark-class", (
            f"service {name} runs {command[0]!r}: the Spark daemons must be the lock's pyspark's "
            "bin/spark-class (on the image's PATH), so Spark's version is the driver's"
        )
    path = spark_image.final.env().get("PATH", "")
    venv = re.search(r"-m venv (\S+)", spark_image.final.runs())
    assert venv, f"{spark_image.path.name} creates no virtualenv for the lock"
    assert path.startswith(f"{venv.group(1)}/bin:"), (
        f"{spark_image.path.name}: PATH {path!r} does not start with the lock's environment "
        f"{venv.group(1)}/bin"
    )


def test_nothing_is_installed_when_a_container_starts(compose):
    assert "_PIP_ADDITIONAL_REQUIREMENTS" not in COMPOSE.read_text(), (
        "docker-compose.yml uses _PIP_ADDITIONAL_REQUIREMENTS (a pip install at every start); "
        "install in docker/airflow.Dockerfile"
    )
    installers = re.compile(r"\b(pip3?|uv|apt-get|apt|conda|mvn)\b.*\b(install|sync|add)\b")
    for name, service in compose["services"].items():
        for key in ("command", "entrypoint"):
            value = service.get(key) or []
            text = value if isinstance(value, str) else " ".join(map(str, value))
            assert not installers.search(text), (
                f"service {name}'s {key} installs software at start: {text!r}"
            )
        for key in service.get("environment", {}):
            assert "PIP_ADDITIONAL_REQUIREMENTS" not in key, f"service {name} sets {key}"


def test_microbatch_variables_match_the_settings_module(compose):
    known = set(Settings.env_names())
    for name, service in compose["services"].items():
        used = {key for key in service.get("environment", {}) if key.startswith("MICROBATCH_")}
        unknown = used - known
        assert not unknown, f"service {name} sets {unknown}, which settings.py does not read"
    for name in [*SPARK_SERVICES, *AIRFLOW_SERVICES]:
        env = compose["services"][name]["environment"]
        assert known <= set(env), f"service {name} misses {known - set(env)}"


# --- the images ----------------------------------------------------------------------------


def test_both_images_run_the_python_minor_of_the_lock(airflow_image, spark_image, lock_python):
    airflow = python_minor(airflow_image.final.base)
    spark = python_minor(spark_image.final.base)

    assert airflow == lock_python, (
        f"the Airflow image {airflow_image.final.base} runs Python {airflow}, "
        f"requirements.lock is compiled for {lock_python}"
    )
    assert spark == airflow, (
        f"the Spark image {spark_image.final.base} runs Python {spark}, the Airflow image (driver) "
        f"{airflow}: PySpark refuses workers of another minor version"
    )
    check = f"sys.version_info[:2] != ({lock_python.replace('.', ', ')})"
    for image in (airflow_image, spark_image):
        for stage in image.stages:
            minor = python_minor(stage.base)
            assert minor in (None, lock_python), (
                f"{image.path.name}: stage on {stage.base} runs Python {minor}, not {lock_python}"
            )
            if "-m venv" in stage.runs():
                assert check in stage.runs(), (
                    f"{image.path.name} builds its environment without checking that python3 "
                    f"is {lock_python}"
                )


def test_a_java_runtime_where_spark_submit_and_the_workers_run(airflow_image, spark_image):
    runtimes = {}
    for image in (airflow_image, spark_image):
        runtime = java_runtime(image.final)
        assert runtime, (
            f"{image.path.name}: the final image installs no Java runtime (spark-submit needs one)"
        )
        assert java_major(runtime) >= 17, (
            f"{image.path.name}: {runtime} is older than Java 17 (Spark 4 needs 17+)"
        )
        env = image.final.env()
        java_home = env.get("JAVA_HOME")
        assert java_home, f"{image.path.name} does not set JAVA_HOME"
        assert f"{java_home}/bin" in env.get("PATH", ""), (
            f"{image.path.name}: $JAVA_HOME/bin is not on PATH"
        )
        if runtime.startswith("eclipse-temurin:"):
            copied = [a for a in image.final.args("COPY") if f"--from={runtime}" in a]
            assert copied and copy_paths(copied[0])[1] == java_home, (
                f"{image.path.name}: the Temurin runtime is not copied to JAVA_HOME ({java_home})"
            )
        runtimes[image.path.name] = runtime
    assert len(set(runtimes.values())) == 1, (
        f"driver and executors run different Java runtimes: {runtimes}"
    )


def test_images_install_the_lock_and_the_library_at_build_time(airflow_image, spark_image, lock):
    for image in (airflow_image, spark_image):
        stages = "\n".join(s.runs() for s in image.stages)
        copies = [a for s in image.stages for a in s.args("COPY")]
        assert any("requirements.lock" in copy_paths(a)[0] for a in copies), (
            f"{image.path.name} does not copy requirements.lock"
        )
        assert any("libs/microbatch" in copy_paths(a)[0] for a in copies), (
            f"{image.path.name} does not copy libs/microbatch"
        )
        install = re.search(r"uv pip install[^&]*-r \S*requirements\.lock[^&]*", stages)
        assert install, f"{image.path.name} does not install requirements.lock (uv pip install -r)"
        assert "libs/microbatch" in install.group(0), (
            f"{image.path.name} does not install libs/microbatch with the lock"
        )
        assert " -e " not in install.group(0), (
            f"{image.path.name} installs the library editable (its source is not mounted)"
        )
        assert "uv pip check" in stages, (
            f"{image.path.name} does not check the environment (uv pip check)"
        )
        for package, version in re.findall(r"\b([A-Za-z0-9._-]+)==([\w.]+)", stages):
            key = package.lower().replace("_", "-")
            if key in lock:
                assert version == lock[key], (
                    f"{image.path.name} installs {package}=={version}, "
                    f"requirements.lock pins {lock[key]}"
                )


def test_images_install_the_dev_package_when_a_mounted_job_imports_the_examples(
    airflow_image, spark_image
):
    # The runtime wheel has no microbatch.examples (libs/microbatch-dev has): a job that
    # imports them needs the dev package where the driver runs (Airflow image) and where
    # its functions run (the Spark image's executors).
    jobs = [
        p.name
        for p in sorted((ROOT / "jobs").glob("*.py"))
        if "microbatch.examples" in p.read_text()
    ]
    if not jobs:
        pytest.skip("no job under jobs/ imports microbatch.examples")
    for image in (airflow_image, spark_image):
        stages = "\n".join(s.runs() for s in image.stages)
        copies = [a for s in image.stages for a in s.args("COPY")]
        assert any("libs/microbatch-dev" in copy_paths(a)[0] for a in copies), (
            f"{image.path.name} does not copy libs/microbatch-dev, which {jobs} import"
        )
        install = re.search(r"uv pip install[^&]*-r \S*requirements\.lock[^&]*", stages)
        assert install and "libs/microbatch-dev" in install.group(0), (
            f"{image.path.name} does not install libs/microbatch-dev with the lock ({jobs})"
        )


def test_the_airflow_image_installs_the_provider_with_the_lock(airflow_image):
    stages = "\n".join(s.runs() for s in airflow_image.stages)
    copies = [copy_paths(a) for s in airflow_image.stages for a in s.args("COPY")]
    provider = [dest for sources, dest in copies if sources == ["plugins"]]
    assert provider, f"{airflow_image.path.name} does not copy plugins/ (the provider distribution)"
    install = re.search(r"uv pip install[^&]*-r \S*requirements\.lock[^&]*", stages)
    assert install and provider[0] in install.group(0), (
        f"{airflow_image.path.name} does not install the provider ({provider[0]}) with the lock"
    )
    assert "microbatch_airflow" in stages, "the image's final check does not import the provider"


def test_the_spark_image_runs_the_locks_pyspark(spark_image, lock):
    text = spark_image.path.read_text()

    assert lock["pyspark"].startswith("4.2."), f"requirements.lock pins pyspark {lock['pyspark']}"
    assert not spark_image.final.base.startswith("apache/spark"), (
        "the Spark image builds on apache/spark: its Spark and Python are not the lock's"
    )
    assert "/opt/spark/" not in text, (
        "the Spark image refers to a Spark distribution other than pyspark's"
    )
    assert not re.search(r"pyspark(\[[^\]]*\])?\s*[=<>~]", spark_image.final.runs()), (
        "the Spark image pins pyspark itself; it must come from requirements.lock"
    )


def test_the_uv_of_make_venv_builds_both_images(airflow_image, spark_image):
    make = re.search(r"^UV_VERSION\s*:?=\s*(\S+)", (ROOT / "Makefile").read_text(), re.M)
    assert make, "the Makefile has no UV_VERSION"
    for image in (airflow_image, spark_image):
        found = re.search(r"^ARG UV_VERSION=(\S+)", image.path.read_text(), re.M)
        assert found and found.group(1) == make.group(1), (
            f"{image.path.name} builds with uv {found and found.group(1)}, "
            f"`make venv` with {make.group(1)}"
        )


def test_pyspark_python_names_the_same_interpreter_on_both_sides(airflow_image, spark_image):
    values = {}
    for image in (airflow_image, spark_image):
        env = image.final.env()
        value = env.get("PYSPARK_PYTHON")
        assert value, f"{image.path.name} does not set PYSPARK_PYTHON"
        assert not value.startswith("/"), (
            f"{image.path.name}: PYSPARK_PYTHON={value} is a path of this image; the driver sends "
            "it to the executors, so it must resolve on both images' PATH"
        )
        venv = env.get("VIRTUAL_ENV")
        assert venv and env.get("PATH", "").startswith(f"{venv}/bin:"), (
            f"{image.path.name}: {value} does not resolve to the lock's environment first on PATH"
        )
        values[image.path.name] = value
    assert len(set(values.values())) == 1, f"PYSPARK_PYTHON differs between the images: {values}"


def test_the_airflow_image_has_the_connector_jars_where_compose_looks(compose, airflow_image):
    home = compose["services"][SPARK_SUBMIT_SERVICE]["environment"]["MICROBATCH_HOME"]
    resolving = [s for s in airflow_image.stages if "ensure_spark_kafka_jars" in s.runs()]

    assert resolving, (
        f"{airflow_image.path.name} does not resolve Spark's Kafka connector at build time"
    )
    assert resolving[0].env().get("MICROBATCH_HOME") == home, (
        f"{airflow_image.path.name} resolves the jars outside MICROBATCH_HOME={home} "
        "(docker-compose.yml)"
    )
    copied = [a for a in airflow_image.final.args("COPY") if f"--from={resolving[0].name}" in a]
    assert any(home.startswith(copy_paths(a)[1]) for a in copied), (
        f"the final Airflow image does not copy {home} from the {resolving[0].name} stage"
    )
    assert airflow_image.final.env().get("MICROBATCH_HOME") == home
    assert "maven" not in airflow_image.final.runs(), "Maven is needed at build time only"


def test_the_airflow_image_has_the_metadata_databases_driver(compose, airflow_image):
    url = compose["services"][SPARK_SUBMIT_SERVICE]["environment"][
        "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"
    ]
    driver = url.split("://")[0].partition("+")[2]

    assert driver == "psycopg2", f"unexpected database driver in {url}"
    installs = "\n".join(s.runs() for s in airflow_image.stages)
    assert re.search(r"psycopg2(-binary)?==\d", installs), (
        f"{airflow_image.path.name} does not install {driver}"
    )


def test_the_build_context_leaves_local_state_out():
    ignored = {
        line.strip().rstrip("/") for line in (ROOT / ".dockerignore").read_text().splitlines()
    }

    for entry in (".venv", ".local", ".git", "**/__pycache__"):
        assert entry in ignored, f".dockerignore does not exclude {entry}"
    for path in sorted((ROOT / "docker").glob("*.Dockerfile")):
        for stage in parse_dockerfile(path).stages:
            for args in stage.args("COPY"):
                if "--from=" in args:
                    continue
                for source in copy_paths(args)[0]:
                    assert (ROOT / source).exists(), f"{path.name} copies {source}, not in the repo"
                    assert source.split("/")[0] not in ignored, (
                        f"{path.name} copies {source}, which .dockerignore leaves out"
                    )
