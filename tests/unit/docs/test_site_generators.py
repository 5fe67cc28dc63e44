"""docs/hooks.py: the CLI reference is the parser's, and the docstrings' reST renders as
Markdown (``make docs`` builds the site itself, strictly)."""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

from microbatch.cli import build_parser

HOOKS_FILE = Path(__file__).resolve().parents[3] / "docs" / "hooks.py"


@pytest.fixture(scope="module")
def hooks() -> ModuleType:
    spec = importlib.util.spec_from_file_location("docs_hooks", HOOKS_FILE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _commands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    (sub,) = (a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def test_cli_page_has_every_command_and_option_of_the_parser(hooks: ModuleType) -> None:
    page = hooks.cli_markdown()
    commands = _commands(build_parser())

    assert commands, "the parser has no subcommands"
    for name, sub in commands.items():
        assert f"## `microbatch {name}`" in page
        for action in sub._actions:
            if action.help == argparse.SUPPRESS or isinstance(action, argparse._HelpAction):
                continue
            for option in action.option_strings:
                assert f"`{option}" in page, (name, option)
    assert "Exit codes" in page


def test_cli_page_leaves_out_suppressed_options(hooks: ModuleType) -> None:
    parser = argparse.ArgumentParser(prog="tool")
    sub = parser.add_subparsers(dest="command")
    go = sub.add_parser("go", help="go somewhere")
    go.add_argument("--fast", action="store_true", help="hurry")
    go.add_argument("--secret", help=argparse.SUPPRESS)

    page = hooks.cli_markdown(parser)

    assert "## `tool go`" in page and "`--fast`" in page and "hurry" in page
    assert "--secret" not in page


def test_rest_roles_become_optional_references(hooks: ModuleType) -> None:
    text = "Uses :class:`~microbatch.runtime.Pipeline` and :func:`run_batch`."

    in_scope = {"run_batch": "microbatch.runtime.protocol.run_batch"}

    got = hooks.rest_to_markdown(text, resolve=lambda name: in_scope.get(name, name))

    assert '<autoref optional identifier="microbatch.runtime.Pipeline"><code>Pipeline<' in got
    assert (
        '<autoref optional identifier="microbatch.runtime.protocol.run_batch">'
        "<code>run_batch</code></autoref>" in got
    )


def test_rest_literal_blocks_become_fenced_code(hooks: ModuleType) -> None:
    text = (
        "Subclass it::\n\n    class A(B):\n        pass\n\nThen run ::\n\n    microbatch run x.py\n"
    )

    got = hooks.rest_to_markdown(text, resolve=str)

    assert "Subclass it:\n\n```python\nclass A(B):\n    pass\n```" in got
    assert "Then run\n\n```text\nmicrobatch run x.py\n```" in got


def test_rest_simple_tables_become_markdown_tables(hooks: ModuleType) -> None:
    text = (
        "=======  =========\n"
        "name     what\n"
        "=======  =========\n"
        "``a``    first\n"
        "         and more\n"
        "``b``    second\n"
        "=======  =========\n"
    )

    got = hooks.rest_to_markdown(text, resolve=str)

    assert "| name | what |\n| --- | --- |\n| ``a`` | first and more |\n| ``b`` | second |" in got
