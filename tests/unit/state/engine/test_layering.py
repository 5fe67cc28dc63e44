"""The state engine's import arrows point down: it imports the per-key state, never the
checkpoint or the runtime; and the per-key state does not import the engine (issue #28)."""

from __future__ import annotations

import ast
from pathlib import Path

import microbatch.state
import microbatch.state.engine

ENGINE = Path(microbatch.state.engine.__file__).parent
STATE = Path(microbatch.state.__file__).parent


def imported_modules(folder: Path) -> dict[str, set[str]]:
    """Each module file of ``folder`` (not its subfolders) → the absolute modules it imports,
    at import time or inside a function."""
    out = {}
    for path in sorted(folder.glob("*.py")):
        names = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names.add(node.module)
        out[path.name] = names
    return out


def test_the_engine_imports_neither_checkpoint_nor_runtime() -> None:
    above = ("microbatch.checkpoint", "microbatch.runtime", "microbatch.dataflow")
    wrong = {
        module: sorted(n for n in names if n.startswith(above))
        for module, names in imported_modules(ENGINE).items()
    }
    assert {m: n for m, n in wrong.items() if n} == {}


def test_the_per_key_state_does_not_import_the_engine() -> None:
    wrong = {
        module: sorted(n for n in names if n.startswith("microbatch.state.engine"))
        for module, names in imported_modules(STATE).items()
    }
    assert {m: n for m, n in wrong.items() if n} == {}
