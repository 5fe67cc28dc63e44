"""Windows in one line: ``process=windows.tumbling("5m").count().sum("amount").final()``.

The result is the pipeline's ``process``: a :class:`WindowedAggregation`, which stage 2
runs on the batch's columns (:mod:`microbatch.runtime.windowed`) rather than per key.
Output rows go to every sink: ``key``, ``window_start``, ``window_end`` (epoch ms) and
one column per aggregate, named after it (``count``, ``sum_amount``, … or ``name=``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from microbatch.errors import ConfigError
from microbatch.runtime.process import KeyedProcessFunction
from microbatch.windows.aggregate import (
    Aggregate,
    Collect,
    Count,
    Custom,
    First,
    Last,
    Max,
    Mean,
    Min,
    Sum,
    check_aggregates,
)
from microbatch.windows.operator import Mode, WindowOperator
from microbatch.windows.spec import Duration, Hopping, Session, Tumbling, WindowSpec, duration_ms


class WindowedAggregation(KeyedProcessFunction):
    """Windows over event time, aggregated column-wise (built by :func:`tumbling`,
    :func:`hopping` or :func:`session`; needs the pipeline's ``event_time``)."""

    columnar = True

    def __init__(self, operator: WindowOperator) -> None:
        self.operator = operator

    def process(self, key: Any, records: Any, ctx: Any) -> None:
        raise ConfigError(
            "a windowed aggregation runs on the batch's columns, not per key; it cannot be "
            "wrapped in another process function"
        )

    def __repr__(self) -> str:
        names = ", ".join(a.name for a in self.operator.aggregates)
        return f"WindowedAggregation({self.operator.spec}, [{names}], {self.operator.mode})"


@dataclasses.dataclass
class WindowBuilder:
    spec: WindowSpec
    aggregates: list[Aggregate] = dataclasses.field(default_factory=list)

    def _add(self, aggregate: Aggregate) -> WindowBuilder:
        self.aggregates.append(aggregate)
        return self

    def count(self, name: str = "count") -> WindowBuilder:
        return self._add(Count(name))

    def sum(self, column: str, name: str | None = None) -> WindowBuilder:
        return self._add(Sum(name or f"sum_{column}", column))

    def min(self, column: str, name: str | None = None) -> WindowBuilder:
        return self._add(Min(name or f"min_{column}", column))

    def max(self, column: str, name: str | None = None) -> WindowBuilder:
        return self._add(Max(name or f"max_{column}", column))

    def mean(self, column: str, name: str | None = None) -> WindowBuilder:
        return self._add(Mean(name or f"mean_{column}", column))

    def first(self, column: str, name: str | None = None) -> WindowBuilder:
        return self._add(First(name or f"first_{column}", column))

    def last(self, column: str, name: str | None = None) -> WindowBuilder:
        return self._add(Last(name or f"last_{column}", column))

    def collect(self, column: str, name: str | None = None) -> WindowBuilder:
        return self._add(Collect(name or f"collect_{column}", column))

    def aggregate(
        self,
        name: str,
        column: str,
        *,
        init: Callable[[], Any],
        add: Callable[[Any, Any], Any],
        merge: Callable[[Any, Any], Any],
        result: Callable[[Any], Any],
        pre_aggregate: bool = False,
    ) -> WindowBuilder:
        """A user aggregate: ``add`` per record (in event-time order), ``merge`` across
        batches (older, newer). ``pre_aggregate=True`` lets stage 1 fold each task's
        records before the exchange, for a ``merge`` that is associative, commutative and
        agrees with ``add`` (see :class:`~microbatch.windows.aggregate.Custom`)."""
        custom = Custom(
            name, column, init=init, add=add, combine=merge, finish=result,
            pre_aggregate=pre_aggregate,
        )  # fmt: skip
        return self._add(custom)

    def final(self, allowed_lateness: Duration | None = None) -> WindowedAggregation:
        """Emit each window once, when the watermark passes its end (+ lateness)."""
        return self._build("final", allowed_lateness)

    def updates(self, allowed_lateness: Duration | None = None) -> WindowedAggregation:
        """Emit every window a batch changed, each batch; forget it once it closes."""
        return self._build("updates", allowed_lateness)

    def _build(self, mode: Mode, allowed_lateness: Duration | None) -> WindowedAggregation:
        if not self.aggregates:
            raise ConfigError(f"a {type(self.spec).__name__.lower()} window needs an aggregate")
        check_aggregates(self.aggregates, None)
        lateness = duration_ms("allowed_lateness", allowed_lateness or 0, allow_zero=True)
        return WindowedAggregation(
            WindowOperator(self.spec, tuple(self.aggregates), mode, lateness)
        )


def tumbling(size: Duration) -> WindowBuilder:
    return WindowBuilder(Tumbling(size))


def hopping(size: Duration, every: Duration) -> WindowBuilder:
    return WindowBuilder(Hopping(size, every))


def session(gap: Duration) -> WindowBuilder:
    return WindowBuilder(Session(gap))
