"""Event-time windows, computed on columns rather than per record.

- :mod:`~microbatch.windows.spec`: tumbling, hopping and session specs;
- :mod:`~microbatch.windows.assign`: which windows each record of a column falls in;
- :mod:`~microbatch.windows.aggregate`: aggregates as Arrow group-by partials that merge
  across batches.

The window operator that runs these inside a batch (state, ``.final()`` / ``.updates()``,
late records) is being built on top (issue #21).
"""

from microbatch.windows.aggregate import (
    Collect,
    Count,
    Custom,
    First,
    Last,
    Max,
    Mean,
    Min,
    Sum,
)
from microbatch.windows.spec import Hopping, Session, Tumbling, WindowSpec, duration_ms

__all__ = [
    "Collect",
    "Count",
    "Custom",
    "First",
    "Hopping",
    "Last",
    "Max",
    "Mean",
    "Min",
    "Session",
    "Sum",
    "Tumbling",
    "WindowSpec",
    "duration_ms",
]
