"""What a Spark Python worker imports to run a batch's stages: every new worker pays it,
so pandas (~0.5 s, pulled in by pyarrow.dataset and pyarrow.acero) must not be among it."""

from __future__ import annotations

import subprocess
import sys

STAGE_MODULES = (
    "microbatch.runtime.stage_one",
    "microbatch.runtime.stage_two",
    "microbatch.runtime.spine",
    "microbatch.runtime.execute",
    "microbatch.dataflow",
    "microbatch.kafka.reader",
)


def test_the_stages_modules_load_without_pandas_or_arrows_dataset() -> None:
    heavy = ("pandas", "pyarrow.dataset", "pyarrow.acero")
    script = (
        "import sys\n"
        + "".join(f"import {m}\n" for m in STAGE_MODULES)
        + f"print(','.join(m for m in {heavy!r} if m in sys.modules))"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True
    )
    assert done.stdout.strip() == "", f"a worker importing the stages also loads {done.stdout}"
