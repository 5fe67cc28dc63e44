"""The API reference (docs/reference/*.md) documents every name its packages export: a
name added to an ``__all__`` and left off a page that picks its members fails here, not on
a reader."""

from __future__ import annotations

import importlib
import re
import textwrap
from pathlib import Path
from typing import Any

import pytest
import yaml

REFERENCE = Path(__file__).resolve().parents[3] / "docs" / "reference"
#: The packages whose whole ``__all__`` the reference must render.
PACKAGES = (
    "microbatch.dataflow",
    "microbatch.enrich",
    "microbatch.joins",
    "microbatch.runtime",
    "microbatch.sinks",
    "microbatch.windows",
)

_DIRECTIVE = re.compile(r"^::: ([\w.]+)\n((?:    .*\n|\n)*)", re.M)


def directives() -> list[tuple[str, dict[str, Any]]]:
    """``(module, options)`` of every ``::: module`` block of the reference pages."""
    found = []
    for page in sorted(REFERENCE.glob("*.md")):
        for m in _DIRECTIVE.finditer(page.read_text() + "\n"):
            config = yaml.safe_load(textwrap.dedent(m.group(2))) or {}
            found.append((m.group(1), config.get("options", {})))
    return found


def rendered_objects() -> list[Any]:
    """The objects the directives render: their ``members``, else every public name."""
    objects = []
    for module_name, options in directives():
        module = importlib.import_module(module_name)
        members = options.get("members")
        if members is False:
            continue
        if members is None:
            members = getattr(module, "__all__", [n for n in vars(module) if n[0] != "_"])
        objects += [getattr(module, name) for name in members]
    return objects


def test_the_reference_pages_have_directives() -> None:
    modules = {module for module, _ in directives()}
    assert set(PACKAGES) <= modules | {"microbatch.windows.api", "microbatch.runtime.protocol"}
    assert {"microbatch.runtime.process", "microbatch.state.handles"} <= modules


@pytest.mark.parametrize("package", PACKAGES)
def test_every_exported_name_is_on_a_reference_page(package: str) -> None:
    module = importlib.import_module(package)
    rendered = rendered_objects()

    missing = [
        name for name in module.__all__ if not any(obj is getattr(module, name) for obj in rendered)
    ]

    assert missing == [], f"{package} exports {missing}: add them to docs/reference/"
