"""Aggregation schemes by name, for configs and command lines: ``build_aggregator("topk", density=0.01)``.

========================  =================================================================  ====================
name                      scheme                                                              state
========================  =================================================================  ====================
``mean``                  :class:`MeanAggregator`: the exact mean (what DDP does)             none
``fp16``, ``bf16``        :class:`LowPrecision`: averaged in float16 / bfloat16 on the wire   none
``topk``                  :class:`TopK`: largest entries as (index, value) pairs              residuals
``randomk``               :class:`RandomK`: a shared random subset of the entries             residuals, generator
``qsgd``                  :class:`QSGD`: unbiased stochastic quantisation                     generator
``minmax``                :class:`MinMaxQuantization`: 8-bit (min, max) quantisation          residuals
``sign``                  :class:`ScaledSign`: EF-SignSGD, 1 bit per element                  residuals
``majority_vote``         :class:`MajorityVote`: signSGD with majority vote                   none
``powersgd``              :class:`PowerSGD`: low-rank approximation                           residuals, Q, generator
========================  =================================================================  ====================
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

from mpistrategy.aggregation.base import Aggregator
from mpistrategy.aggregation.low_precision import LowPrecision
from mpistrategy.aggregation.majority_vote import MajorityVote
from mpistrategy.aggregation.mean import MeanAggregator
from mpistrategy.aggregation.minmax import MinMaxQuantization
from mpistrategy.aggregation.powersgd import PowerSGD
from mpistrategy.aggregation.qsgd import QSGD
from mpistrategy.aggregation.randomk import RandomK
from mpistrategy.aggregation.sign import ScaledSign
from mpistrategy.aggregation.topk import TopK

SCHEMES: dict[str, Callable[..., Aggregator]] = {
    "mean": MeanAggregator,
    "fp16": partial(LowPrecision, dtype="float16"),
    "bf16": partial(LowPrecision, dtype="bfloat16"),
    "topk": TopK,
    "randomk": RandomK,
    "qsgd": QSGD,
    "minmax": MinMaxQuantization,
    "sign": ScaledSign,
    "majority_vote": MajorityVote,
    "powersgd": PowerSGD,
}


def build_aggregator(name: str, **options: Any) -> Aggregator:
    """The aggregator registered as ``name``, built with ``options`` (its constructor's keyword arguments).

    Raises ``ValueError`` naming the valid names for an unknown ``name``, and ``TypeError`` naming the accepted
    options for an unknown option.
    """
    factory = SCHEMES.get(name) if isinstance(name, str) else None
    if factory is None:
        raise ValueError(f"unknown aggregation scheme {name!r}; valid names: {', '.join(SCHEMES)}.")
    try:
        return factory(**options)
    except TypeError as error:
        if "unexpected keyword argument" not in str(error):
            raise
        raise TypeError(f"aggregation scheme {name!r}: {error}; it accepts {_parameters(factory)}.") from None


def _parameters(factory: Callable[..., Aggregator]) -> str:
    import inspect

    fixed = factory.keywords if isinstance(factory, partial) else {}
    target = factory.func if isinstance(factory, partial) else factory
    names = [n for n in inspect.signature(target).parameters if n not in fixed]
    return ", ".join(names) if names else "no options"


def aggregator_from(aggregator: Aggregator | str | None) -> Aggregator:
    """``aggregator`` as given, built by name with its default options (:func:`build_aggregator`), or the exact
    mean for ``None``; ``TypeError`` for anything else."""
    if aggregator is None:
        return MeanAggregator()
    if isinstance(aggregator, str):
        return build_aggregator(aggregator)
    if not isinstance(aggregator, Aggregator):
        raise TypeError(
            f"aggregator={aggregator!r} is neither an Aggregator nor the name of one ({', '.join(SCHEMES)})."
        )
    return aggregator
