"""Bytes per step on the benchmark MLP (784-1024-1024-10, float32, the strategy's default buckets for compressing
aggregators, also with shared memory on: the two large weights in own-gradient buckets, the rest in one flat
bucket), counted by the traffic counter every aggregator feeds, against the dense mean's."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from mpistrategy.aggregation import (
    QSGD,
    LowPrecision,
    MajorityVote,
    MeanAggregator,
    MinMaxQuantization,
    PowerSGD,
    RandomK,
    ScaledSign,
    TopK,
)
from mpistrategy.comm.topology import topology
from mpistrategy.strategy.reducer import GradientReducer
from tests.aggregation.helpers import RANK

PARAMETERS = 784 * 1024 + 1024 + 1024 * 1024 + 1024 + 1024 * 10 + 10
DENSE = 4 * PARAMETERS


def _aligned(nbytes: int) -> int:
    return -(-nbytes // 8) * 8


def _step(aggregator) -> tuple[int, list[int], list[int]]:
    """Bytes this rank sent in one training step through the reducer, the buckets' sizes and parameter counts."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(784, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10))
    reducer = GradientReducer(model, aggregator, topology())
    generator = torch.Generator().manual_seed(RANK)
    x, y = torch.randn(8, 784, generator=generator), torch.randint(0, 10, (8,), generator=generator)
    reducer.prepare(sync=True)
    nn.functional.cross_entropy(model(x), y).backward()
    reducer.wait()
    sizes, counts = [b.buffer.numel() for b in reducer.buckets], [len(b.names) for b in reducer.buckets]
    reducer.remove()
    node, inter_node = reducer.traffic.take()
    return node + inter_node, sizes, counts


@pytest.mark.mpi(ranks=(2, 3), timeout=120)
def test_bytes_per_step_against_the_dense_mean() -> None:
    assert _step(MeanAggregator())[0] == DENSE  # its layout depends on shared memory (one bucket when on)

    topk, sizes, counts = _step(TopK(density=0.01))
    assert sorted(sizes) == sorted([784 * 1024, 1024 * 1024, 1024 + 1024 + 1024 * 10 + 10])  # as without it
    assert topk == sum(2 * _aligned(4 * math.ceil(0.01 * n)) for n in sizes)
    assert topk <= 0.022 * DENSE

    powersgd = _step(PowerSGD(rank=1, start_iter=0))[0]
    assert powersgd == 4 * ((1024 + 784) + (1024 + 1024) + (10 + 1024) + 1024 + 1024 + 10)
    assert powersgd <= 0.01 * DENSE

    sign = _step(ScaledSign())[0]
    signs = sum(_aligned(math.ceil(n / 8)) for n in sizes)
    assert sign == signs + sum(_aligned(4 * count) for count in counts)  # a float32 scale per parameter
    assert sign <= DENSE / 32 + 32 * len(sizes)  # 1 bit per element plus a few bytes per bucket

    vote = _step(MajorityVote(scaled=False))[0]
    assert vote == signs and vote <= DENSE / 32 + 8 * len(sizes)

    assert _step(RandomK(density=0.01))[0] == sum(4 * math.ceil(0.01 * n) for n in sizes)
    assert _step(LowPrecision("float16"))[0] == DENSE // 2
    qsgd = _step(QSGD(levels=127, block_size=512))[0]
    assert qsgd == sum(_aligned(n) + _aligned(4 * math.ceil(n / 512)) for n in sizes)  # 8-bit codes, a norm per block
    assert qsgd <= 0.26 * DENSE
    minmax = _step(MinMaxQuantization(bits=8, block_size=1024))[0]
    assert minmax == sum(_aligned(n) + 2 * _aligned(4 * math.ceil(n / 1024)) for n in sizes)
    assert minmax <= 0.26 * DENSE
