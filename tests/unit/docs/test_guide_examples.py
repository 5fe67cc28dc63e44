"""Every Python block of the user guide (docs/*.md and README.md) is checked, so a renamed
API breaks this test rather than the reader.

A block is one of three kinds, told by an HTML comment on the line right before its fence
(invisible on GitHub and on the site):

- no marker: a complete example. It runs, in a fresh folder, after the page's earlier
  complete blocks and in their namespace, as a reader pasting the page in order would.
- ``<!-- compile-only: why -->``: complete, but it needs a live service (Spark, S3, a
  table). It must compile, and every module and name it imports must exist; running it
  would need services that unit tests do not start.
- ``<!-- fragment -->`` or ``<!-- fragment: why -->``: a piece of a larger program on
  purpose (names defined elsewhere, ``...`` for the rest). Its imports of ``microbatch``
  and ``microbatch_airflow`` must still resolve.

docs/dataflow.md and docs/joins.md are left out: their own tests run them
(tests/integration/dataflow/test_docs.py on real Kafka and Spark, tests/unit/joins/
test_docs.py).
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import os
import re
import textwrap
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[3]
#: Pages whose blocks their own tests run.
RUN_ELSEWHERE = ("dataflow.md", "joins.md")
PAGES = [
    *sorted(p for p in (ROOT / "docs").glob("*.md") if p.name not in RUN_ELSEWHERE),
    ROOT / "README.md",
]
FIRST_PARTY = ("microbatch", "microbatch_airflow")

#: A ```python (or ```py) block, also indented in a list item.
_FENCE = re.compile(r"^([ \t]*)```(?:python|py)\b[^\n]*\n(.*?)^\1```[ \t]*$", re.M | re.S)
_MARKER = re.compile(r"^<!--\s*(fragment|compile-only)\s*(?::\s*(.*?))?\s*-->$")
#: Section markers of pymdownx.snippets (the site includes README's block by them).
_SNIPPET = re.compile(r"^<!--\s*--8<--.*-->$")


@dataclasses.dataclass(frozen=True)
class Block:
    """One ```python block of a page: where it starts (the fence's line), its code, its
    kind (``run``, ``compile-only`` or ``fragment``) and the marker's reason."""

    page: Path
    line: int
    code: str
    kind: str
    reason: str

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks(page: Path) -> list[Block]:
    text = page.read_text()
    found = []
    for m in _FENCE.finditer(text):
        line = text.count("\n", 0, m.start()) + 1
        before = text[: m.start()].split("\n")[:-1]
        while before and _SNIPPET.match(before[-1].strip()):
            before.pop()
        prev = before[-1].strip() if before else ""
        if prev.startswith("<!--") and not _MARKER.match(prev):
            raise AssertionError(
                f"{page.name}:{line}: {prev!r} before a python block is not a marker;"
                " write <!-- fragment: why --> or <!-- compile-only: why -->"
            )
        marker = _MARKER.match(prev)
        kind, reason = (marker.group(1), marker.group(2) or "") if marker else ("run", "")
        found.append(Block(page, line, textwrap.dedent(m.group(2)), kind, reason))
    return found


def imports(block: Block) -> list[tuple[str, tuple[str, ...]]]:
    """``(module, names)`` of every import in the block; a block that is not Python as a
    whole (a fragment) gives the imports among its lines that are."""
    try:
        tree = ast.parse(block.code)
    except SyntaxError:
        tree = ast.Module(body=list(_import_lines(block.code)), type_ignores=[])
    found: list[tuple[str, tuple[str, ...]]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, ()) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.module, tuple(alias.name for alias in node.names)))
    return found


def _import_lines(code: str) -> list[ast.stmt]:
    lines = code.split("\n")
    statements: list[ast.stmt] = []
    for i, line in enumerate(lines):
        if not re.match(r"(from \S+ )?import ", line):
            continue
        for end in range(i + 1, min(i + 6, len(lines)) + 1):  # a parenthesized import
            try:
                statements += ast.parse("\n".join(lines[i:end])).body
                break
            except SyntaxError:
                continue
    return statements


def unresolved(block: Block, first_party_only: bool) -> list[str]:
    """The imports of ``block`` that do not resolve: a missing module or name."""
    missing = []
    for module, names in imports(block):
        if first_party_only and module.split(".")[0] not in FIRST_PARTY:
            continue
        try:
            imported = importlib.import_module(module)
        except ImportError as e:
            missing.append(f"{module} ({e})")
            continue
        for name in names:
            if hasattr(imported, name):
                continue
            try:
                importlib.import_module(f"{module}.{name}")
            except ImportError:
                missing.append(f"{module}.{name}")
    return missing


ALL_BLOCKS = [b for page in PAGES for b in blocks(page)]


def test_the_guide_has_examples_of_every_kind() -> None:
    kinds = {kind: [b for b in ALL_BLOCKS if b.kind == kind] for kind in ("run", "fragment")}
    assert len(kinds["run"]) >= 8, [b.where for b in kinds["run"]]
    assert kinds["fragment"], "no fragment marker found: is the marker pattern still right?"
    assert {p.name for p in PAGES} >= {"README.md", "runtime.md", "state.md", "windows.md"}


def test_every_compile_only_block_says_why() -> None:
    assert [b.where for b in ALL_BLOCKS if b.kind == "compile-only" and not b.reason] == []


@pytest.mark.parametrize(
    "page", sorted({b.page for b in ALL_BLOCKS if b.kind == "run"}), ids=lambda p: p.name
)
def test_complete_examples_run_in_order(
    page: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    runnable = [b for b in blocks(page) if b.kind == "run"]
    monkeypatch.chdir(tmp_path)
    if "AIRFLOW_HOME" not in os.environ:  # a DAG example imports Airflow
        monkeypatch.setenv("AIRFLOW_HOME", str(tmp_path / "airflow"))
    # As a file in a folder of its own: a DAG file finds its job through __file__.
    namespace: dict[str, Any] = {
        "__name__": f"docs_{page.stem}",
        "__file__": str(tmp_path / "dags" / f"{page.stem}.py"),
    }
    for block in runnable:
        # Padded so that a traceback's line numbers are the page's.
        code = compile("\n" * block.line + block.code, str(block.page), "exec")
        try:
            exec(code, namespace)
        except Exception as e:
            raise AssertionError(f"the example at {block.where} fails: {e!r}") from e


@pytest.mark.parametrize(
    "block",
    [b for b in ALL_BLOCKS if b.kind == "compile-only"],
    ids=lambda b: b.where,
)
def test_compile_only_examples_compile_and_their_imports_exist(block: Block) -> None:
    compile(block.code, block.where, "exec")
    assert unresolved(block, first_party_only=False) == [], block.where


@pytest.mark.parametrize(
    "block",
    [b for b in ALL_BLOCKS if b.kind == "fragment"],
    ids=lambda b: b.where,
)
def test_fragments_import_only_what_the_library_has(block: Block) -> None:
    assert unresolved(block, first_party_only=True) == [], block.where
