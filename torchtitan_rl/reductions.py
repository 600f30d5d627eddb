"""Metric values that carry their own reduction, and the one place that combines them.

A metric is reported by many parts (microbatches, data-parallel ranks, the minibatch
updates of one RL step, the batches of a step) and each kind combines differently: a mean
must be kept as (sum, count), because a mean of means weights every part alike however
much data stood behind it. Example: two microbatches with 3 and 1 tokens whose token means
are 1.0 and 5.0: the step's mean is (3 * 1.0 + 1 * 5.0) / 4 = 2.0, not (1.0 + 5.0) / 2 = 3.0.
So every value says how it combines, and nothing is decided by how its key is spelled.

    Metric.mean(total, count)   sum and count add; result total / count (none when count is 0)
    Metric.sum(v)               values add
    Metric.max(v), Metric.min(v) extreme value; +-inf is "nothing seen" and is not reported
    Metric.last(v)              the later part wins (counters such as the policy version)

Values may be Python floats or 0-d tensors (the trainer keeps tensors until the end of a
step, so a GPU syncs once); `results` wants floats.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any


class Reduce(StrEnum):
    MEAN = "mean"
    SUM = "sum"
    MAX = "max"
    MIN = "min"
    LAST = "last"


@dataclass(frozen=True, slots=True)
class Metric:
    """One reported value and how it combines with another report of the same key."""

    reduce: Reduce
    value: Any
    """float or 0-d tensor; for MEAN the sum of the values."""
    count: Any = 1.0
    """MEAN only: how many values (or how much weight) `value` sums."""

    @classmethod
    def mean(cls, total: Any, count: Any) -> Metric:
        return cls(Reduce.MEAN, total, count)

    @classmethod
    def sum(cls, value: Any) -> Metric:
        return cls(Reduce.SUM, value)

    @classmethod
    def max(cls, value: Any) -> Metric:
        return cls(Reduce.MAX, value)

    @classmethod
    def min(cls, value: Any) -> Metric:
        return cls(Reduce.MIN, value)

    @classmethod
    def last(cls, value: Any) -> Metric:
        return cls(Reduce.LAST, value)

    def merge(self, later: Metric) -> Metric:
        """This report combined with a later one of the same key."""
        if later.reduce != self.reduce:
            raise ValueError(f"cannot merge a {self.reduce} metric with a {later.reduce} one")
        if self.reduce == Reduce.MEAN:
            return Metric(Reduce.MEAN, self.value + later.value, self.count + later.count)
        if self.reduce == Reduce.SUM:
            return Metric(Reduce.SUM, self.value + later.value)
        if self.reduce == Reduce.MAX:
            return later if later.value > self.value else self
        if self.reduce == Reduce.MIN:
            return later if later.value < self.value else self
        return later

    def result(self) -> float | None:
        """The reported number; None when nothing stands behind it (an empty mean, an
        extreme over no values)."""
        value = float(self.value)
        if self.reduce == Reduce.MEAN:
            count = float(self.count)
            return value / count if count else None
        if self.reduce in (Reduce.MAX, Reduce.MIN) and math.isinf(value):
            return None
        return value


Metrics = dict[str, Metric]


def merge(parts: Iterable[Mapping[str, Metric]]) -> Metrics:
    """Key-wise combination of reports, in order (so LAST keeps the latest part's value)."""
    merged: Metrics = {}
    for part in parts:
        for key, metric in part.items():
            merged[key] = merged[key].merge(metric) if key in merged else metric
    return merged


def results(metrics: Mapping[str, Metric]) -> dict[str, float]:
    """Plain numbers to log; keys with nothing behind them are left out."""
    out = {}
    for key, metric in metrics.items():
        value = metric.result()
        if value is not None:
            out[key] = value
    return out
