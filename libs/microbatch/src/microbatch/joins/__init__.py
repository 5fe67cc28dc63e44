"""Joins as keyed steps with two inputs: ``a.key_by(...).join(b.key_by(...), <join>)``.

Each join is a :class:`~microbatch.runtime.process.KeyedProcessFunction` whose records
come as :class:`~microbatch.runtime.process.Sided` (side 0: left, side 1: right), with its
buffers in keyed state and event-time timers, so it checkpoints, rescales and replays
like any keyed step. One module per join:

- :mod:`~microbatch.joins.interval`: :class:`IntervalJoin`, pairs within a time interval
  (inner, left, right, full outer);
- :mod:`~microbatch.joins.table`: :class:`TableJoin`, a stream with a changelog topic's
  latest value per key (inner, left);
- :mod:`~microbatch.joins.temporal`: :class:`TemporalJoin`, the version valid at the
  stream record's time (as-of; inner, left);
- :mod:`~microbatch.joins.window`: :class:`WindowJoin`, pairs in the same tumbling or
  hopping window;
- :mod:`~microbatch.joins.select`: :func:`merge`, the default output record, and
  :func:`fields`, the output as named fields of each side (what a join can run on
  columns).

Late records become dead letters ``late_join``; records without an event time,
``missing_event_time``. Test a join (or any process function) without Spark with
:class:`microbatch.testing.ProcessHarness`.
"""

from microbatch.joins.interval import IntervalJoin
from microbatch.joins.select import fields, merge
from microbatch.joins.table import TableJoin
from microbatch.joins.temporal import TemporalJoin
from microbatch.joins.window import WindowJoin

__all__ = ["IntervalJoin", "TableJoin", "TemporalJoin", "WindowJoin", "fields", "merge"]
