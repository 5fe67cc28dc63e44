"""Event-time windows: which windows a record falls in (this package), computed on
columns, not per record. See docs/windows.md once the aggregation layer lands."""

from microbatch.windows.spec import Hopping, Session, Tumbling, WindowSpec, duration_ms

__all__ = ["Hopping", "Session", "Tumbling", "WindowSpec", "duration_ms"]
