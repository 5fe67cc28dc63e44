"""docs/joins.md runs as written: its python blocks, in order, in one namespace."""

from __future__ import annotations

import re
from pathlib import Path

DOC = Path(__file__).resolve().parents[3] / "docs" / "joins.md"


def test_every_python_block_of_the_guide_runs():
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)
    assert len(blocks) >= 2
    namespace: dict = {"__name__": "docs_joins"}
    for block in blocks:
        exec(compile(block, str(DOC), "exec"), namespace)
    assert namespace["pipeline"].uid == "bid-auction"
