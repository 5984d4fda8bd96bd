"""Starts put off until the pass is finished (``DeferredStarts``, what the reducer does with a compressor's CUDA
buckets): the buckets are started in bucket order once the first is finished, or before a bucket started where
it lands, and every scheme combines them to the same bits as when each bucket starts as it lands.

The CUDA path itself is trained on a GPU in ``tests/gpu/test_training.py``; here the wrapper is driven on host
buckets, as the reducer drives it.
"""

from __future__ import annotations

import pytest
import torch

from mpistrategy.aggregation import Aggregator, GradBucket, Work, build_aggregator
from mpistrategy.strategy.reducer.deferred import DeferredStarts
from tests.aggregation.helpers import RANK, bucket, combine, rank_tensor, setup

SHAPES = [[(6, 10), (10,)], [(32, 24)], [(12, 8), (8,)]]
SCHEMES = {
    "powersgd": {"rank": 2, "start_iter": 1},
    "topk": {"density": 0.2, "error_feedback": True},
    "qsgd": {"levels": 4},
    "fp16": {},
    "majority_vote": {},
}


class StartOrder(Aggregator):
    """``inner``, noting the index of every bucket it is asked to start."""

    def __init__(self, inner: Aggregator) -> None:
        self.inner, self.started = inner, []

    def setup(self, context) -> None:
        super().setup(context)
        self.inner.setup(context)

    def start(self, bucket: GradBucket) -> Work:
        self.started.append(bucket.index)
        return self.inner.start(bucket)

    def finish(self, bucket: GradBucket, work: Work) -> None:
        self.inner.finish(bucket, work)


def _buckets() -> list[GradBucket]:
    return [bucket(shapes, index, torch.float64, own=index == 1) for index, shapes in enumerate(SHAPES)]


def _gradients(buckets: list[GradBucket], round_: int) -> list[torch.Tensor]:
    return [rank_tensor(b.buffer.numel(), RANK, seed=10 * round_ + b.index, dtype=torch.float64) for b in buckets]


@pytest.mark.mpi(ranks=(1, 2, 3, 4))
@pytest.mark.parametrize("deferred", [(0, 1, 2), (0, 2)], ids=["all", "first-and-last"])
@pytest.mark.parametrize("scheme", sorted(SCHEMES))
def test_deferred_starts_combine_to_the_same_bits(scheme: str, deferred: tuple[int, ...]) -> None:
    """Four rounds (error feedback, PowerSGD's warm start and QSGD's generator carry over), deferred against
    started as they land."""
    results = []
    for wrap in (False, True):
        inner = build_aggregator(scheme, **SCHEMES[scheme])
        aggregator: Aggregator = DeferredStarts(inner, frozenset(deferred)) if wrap else inner
        buckets = _buckets()
        setup(inner, buckets)
        rounds = []
        for round_ in range(4):
            combine(aggregator, buckets, _gradients(buckets, round_))
            rounds.append(torch.cat([b.buffer.clone() for b in buckets]))
        results.append(torch.stack(rounds))
    direct, wrapped = results
    assert torch.isfinite(direct).all() and direct.abs().sum() > 0
    assert torch.equal(wrapped, direct)


@pytest.mark.mpi(ranks=(1, 3))
def test_noted_buckets_start_in_order_when_the_first_is_finished_or_a_later_one_starts() -> None:
    recorder = StartOrder(build_aggregator("topk", density=0.5))
    buckets = _buckets()
    setup(recorder, buckets)
    for b, gradient in zip(buckets, _gradients(buckets, 0), strict=True):
        b.buffer.copy_(gradient)

    deferred = DeferredStarts(recorder, frozenset({0, 1}))
    works = [deferred.start(buckets[0]), deferred.start(buckets[1])]
    assert recorder.started == [] and not works[0].test()
    works.append(deferred.start(buckets[2]))  # a bucket started where it lands: those noted before it go first
    assert recorder.started == [0, 1, 2]
    for b, work in zip(buckets, works, strict=True):
        deferred.finish(b, work)

    recorder.started.clear()
    works = [deferred.start(b) for b in buckets[:2]]
    assert recorder.started == []
    deferred.finish(buckets[0], works[0])
    assert recorder.started == [0, 1]
    deferred.finish(buckets[1], works[1])
    assert recorder.started == [0, 1]
