"""Gradient aggregation schemes: how the strategy combines gradient buckets across ranks.

:class:`Aggregator` is the interface (see :mod:`mpistrategy.aggregation.base`); :class:`MeanAggregator` is the
default, a non-blocking in-place average over all ranks. The compressing schemes send less: half precision
(:class:`LowPrecision`), sparsification (:class:`TopK`, :class:`RandomK`), quantisation (:class:`QSGD`,
:class:`MinMaxQuantization`), signs (:class:`ScaledSign`, :class:`MajorityVote`) and low rank (:class:`PowerSGD`);
:func:`build_aggregator` builds any of them by name (see :mod:`mpistrategy.aggregation.registry`). A scheme of
your own subclasses :class:`Aggregator`, :class:`CompressingAggregator` or, for messages that are gathered rather
than summed, :class:`GatheredCompressor`.
"""

from mpistrategy.aggregation.base import AggregationContext, Aggregator, GradBucket, Work
from mpistrategy.aggregation.compression import CompressingAggregator
from mpistrategy.aggregation.gathered import GatheredCompressor
from mpistrategy.aggregation.low_precision import LowPrecision
from mpistrategy.aggregation.majority_vote import MajorityVote
from mpistrategy.aggregation.mean import MeanAggregator
from mpistrategy.aggregation.minmax import MinMaxQuantization
from mpistrategy.aggregation.powersgd import PowerSGD
from mpistrategy.aggregation.qsgd import QSGD
from mpistrategy.aggregation.randomk import RandomK
from mpistrategy.aggregation.registry import SCHEMES, build_aggregator
from mpistrategy.aggregation.sign import ScaledSign
from mpistrategy.aggregation.topk import TopK

__all__ = [
    "QSGD",
    "SCHEMES",
    "AggregationContext",
    "Aggregator",
    "CompressingAggregator",
    "GatheredCompressor",
    "GradBucket",
    "LowPrecision",
    "MajorityVote",
    "MeanAggregator",
    "MinMaxQuantization",
    "PowerSGD",
    "RandomK",
    "ScaledSign",
    "TopK",
    "Work",
    "build_aggregator",
]
