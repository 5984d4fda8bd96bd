"""Gradient aggregation schemes: how the strategy combines gradient buckets across ranks.

:class:`Aggregator` is the interface (see :mod:`mpistrategy.aggregation.base`); :class:`MeanAggregator` is the
default, a non-blocking in-place average over all ranks.
"""

from mpistrategy.aggregation.base import AggregationContext, Aggregator, GradBucket, Work
from mpistrategy.aggregation.mean import MeanAggregator

__all__ = ["AggregationContext", "Aggregator", "GradBucket", "MeanAggregator", "Work"]
