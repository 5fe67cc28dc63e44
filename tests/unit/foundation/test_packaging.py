"""Two distributions, one package: the runtime wheel executors install (``microbatch``,
libs/microbatch) carries no local stack, demo or examples; the dev wheel
(``microbatch-dev``, libs/microbatch-dev) carries exactly those, as portions of the same
package ``microbatch``, and never a ``microbatch/__init__.py`` of its own (in a shared
site-packages it would overwrite the library's).

Both wheels are built from clean copies of the two projects with ``uv build --offline``:
offline, because ``make venv`` has built both projects already and uv keeps the build
backend (setuptools) in its cache. The venv's own pip cannot do it offline: its setuptools
is older than the projects' ``setuptools>=68`` and it has no ``wheel`` package."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
import tomllib
import zipfile
from importlib.metadata import version
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
RUNTIME = ROOT / "libs" / "microbatch"
DEV = ROOT / "libs" / "microbatch-dev"
#: What only the dev distribution ships, under the package folder ``microbatch/``.
DEV_ONLY = ("microbatch/localstack/", "microbatch/examples/", "microbatch/demo.py")
POMS = {"kafka-pom.xml", "spark-kafka-pom.xml", "delta-spark-pom.xml"}


def _uv() -> str:
    found = Path(sys.executable).with_name("uv")
    if found.exists():
        return str(found)
    which = shutil.which("uv")
    if not which:
        pytest.fail("uv is missing: `make venv` installs it next to the venv's Python")
    return which


def _build_wheel(project: Path, workdir: Path) -> dict[str, str]:
    """Build ``project``'s wheel from a copy holding only its sources: a build/ or
    egg-info left in the working tree (stale files of moved modules) cannot leak in."""
    copy = workdir / project.name
    shutil.copytree(
        project,
        copy,
        ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", "build", "dist"),
    )
    out = workdir / "dist"
    done = subprocess.run(
        [_uv(), "build", "--offline", "--wheel", "--quiet", "--out-dir", str(out), str(copy)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    if done.returncode != 0:
        pytest.fail(
            f"uv build --offline {project.name} failed (exit {done.returncode}; is setuptools "
            f"in uv's cache? `make venv` puts it there):\n{done.stderr[-2000:]}"
        )
    name = tomllib.loads((project / "pyproject.toml").read_text())["project"]["name"]
    (wheel,) = out.glob(f"{name.replace('-', '_')}-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        return {
            n: archive.read(n).decode() if n.endswith(".txt") else "" for n in archive.namelist()
        }


@pytest.fixture(scope="module")
def wheels(tmp_path_factory) -> dict[str, dict[str, str]]:
    """Both wheels' files (name → text of the metadata's .txt files), by distribution."""
    workdir = tmp_path_factory.mktemp("wheels")
    return {
        "microbatch": _build_wheel(RUNTIME, workdir),
        "microbatch-dev": _build_wheel(DEV, workdir),
    }


def _package_files(wheel: dict[str, str]) -> set[str]:
    return {n for n in wheel if n.startswith("microbatch/")}


def _console_scripts(wheel: dict[str, str]) -> list[str]:
    (text,) = [t for n, t in wheel.items() if n.endswith(".dist-info/entry_points.txt")]
    section = text.partition("[console_scripts]")[2].partition("[")[0]
    return sorted(line.strip() for line in section.splitlines() if line.strip())


def test_runtime_wheel_has_no_local_stack_demo_or_examples(wheels):
    files = _package_files(wheels["microbatch"])

    assert "microbatch/__init__.py" in files
    assert "microbatch/runtime/__init__.py" in files
    assert "microbatch/spark_jars.py" in files  # the runtime's jar lookup, not the stack's
    assert [f for f in files if f.startswith(DEV_ONLY) or f.endswith(".xml")] == []


def test_dev_wheel_ships_the_local_stack_demo_examples_and_poms_and_no_package_init(wheels):
    files = _package_files(wheels["microbatch-dev"])

    assert "microbatch/localstack/__main__.py" in files
    assert "microbatch/examples/clickstream.py" in files
    assert "microbatch/demo.py" in files
    assert {f"microbatch/localstack/{pom}" for pom in POMS} <= files
    assert "microbatch/__init__.py" not in files  # would overwrite the library's
    assert [f for f in files if not f.startswith(DEV_ONLY)] == []


def test_the_two_wheels_together_hold_every_source_file_once(wheels):
    runtime, dev = _package_files(wheels["microbatch"]), _package_files(wheels["microbatch-dev"])
    sources = {
        f"microbatch/{path.relative_to(src).as_posix()}"
        for src in (RUNTIME / "src" / "microbatch", DEV / "src" / "microbatch")
        for path in src.rglob("*")
        if path.is_file() and path.suffix in {".py", ".xml", ".typed"}
    }

    assert runtime & dev == set()
    assert runtime | dev == sources


def test_microbatch_stack_is_the_dev_wheels_script(wheels):
    assert _console_scripts(wheels["microbatch"]) == ["microbatch = microbatch.cli:console"]
    assert _console_scripts(wheels["microbatch-dev"]) == [
        "microbatch-stack = microbatch.localstack.__main__:main"
    ]


def test_dev_distribution_is_released_with_the_library_and_pins_it():
    runtime = tomllib.loads((RUNTIME / "pyproject.toml").read_text())["project"]
    dev = tomllib.loads((DEV / "pyproject.toml").read_text())["project"]

    assert dev["version"] == runtime["version"] == version("microbatch-dev")
    assert f"microbatch[spark,delta]=={runtime['version']}" in dev["dependencies"]


def _imported_modules(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def test_the_runtime_imports_nothing_from_the_dev_distribution():
    dev_modules = ("microbatch.localstack", "microbatch.examples", "microbatch.demo")
    offenders = {
        str(path.relative_to(ROOT)): sorted(
            m
            for m in _imported_modules(path)
            if m in dev_modules or m.startswith(tuple(f"{d}." for d in dev_modules))
        )
        for path in (RUNTIME / "src").rglob("*.py")
    }

    assert {path: mods for path, mods in offenders.items() if mods} == {}
