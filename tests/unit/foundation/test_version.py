"""The library says which version it is, and ships its type annotations (PEP 561)."""

from __future__ import annotations

import tomllib
from importlib.metadata import version
from pathlib import Path

import pytest

import microbatch
from microbatch.cli import main

PACKAGE = Path(microbatch.__file__).parent
PYPROJECT = PACKAGE.parents[1] / "pyproject.toml"


def test_version_is_the_installed_distributions_which_is_the_pyprojects():
    declared = tomllib.loads(PYPROJECT.read_text())["project"]["version"]

    assert microbatch.__version__ == version("microbatch") == declared


def test_a_source_tree_that_was_never_installed_says_unknown_rather_than_guessing():
    assert microbatch._installed_version("microbatch-not-installed-here") == "0+unknown"


def test_cli_version_prints_the_library_version(capsys):
    with pytest.raises(SystemExit) as done:
        main(["--version"])

    assert done.value.code == 0
    assert capsys.readouterr().out.strip() == f"microbatch {microbatch.__version__}"


def test_the_package_ships_a_py_typed_marker():
    package_data = tomllib.loads(PYPROJECT.read_text())["tool"]["setuptools"]["package-data"]

    assert (PACKAGE / "py.typed").is_file()
    assert "py.typed" in package_data["microbatch"]
