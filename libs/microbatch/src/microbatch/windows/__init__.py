"""Event-time windows, computed on columns rather than per record.

- :mod:`~microbatch.windows.spec`: tumbling, hopping and session specs;
- :mod:`~microbatch.windows.assign`: which windows each record of a column falls in;
- :mod:`~microbatch.windows.aggregate`: aggregates as Arrow group-by partials that merge
  across batches;
- :mod:`~microbatch.windows.python_merge`: ``collect``'s and custom aggregates' partials
  merged across stage 1's tasks;
- :mod:`~microbatch.windows.panes`: hopping windows reduced per pane, then per window.

- :mod:`~microbatch.windows.operator`: one batch of open windows, emitted as they close;
- :mod:`~microbatch.windows.api`: ``windows.tumbling("5m").count().sum("x").final()``, a
  pipeline's ``process`` (stage 2 runs it column-wise: :mod:`microbatch.runtime.windowed`).
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
from microbatch.windows.api import WindowedAggregation, hopping, session, tumbling
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
    "WindowedAggregation",
    "duration_ms",
    "hopping",
    "session",
    "tumbling",
]
