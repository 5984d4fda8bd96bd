"""Gradient buckets built by hand, driven through an aggregator exactly as the reducer drives them."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from mpi4py import MPI
from torch import nn

from mpistrategy.aggregation import AggregationContext, Aggregator, GradBucket
from mpistrategy.comm.topology import topology
from mpistrategy.comm.traffic import TrafficCounter

COMM = MPI.COMM_WORLD
RANK = COMM.Get_rank()
SIZE = COMM.Get_size()


def bucket(
    shapes: Sequence[tuple[int, ...]], index: int = 0, dtype: torch.dtype = torch.float32, own: bool = False
) -> GradBucket:
    """A bucket of parameters of ``shapes`` (named ``b<index>.p<j>``) whose gradients are views of one zero
    buffer; ``own``: one parameter whose gradient is the buffer itself."""
    params = [nn.Parameter(torch.zeros(shape, dtype=dtype)) for shape in shapes]
    numels = [p.numel() for p in params]
    offsets = [sum(numels[:i]) for i in range(len(numels))]
    buffer = torch.zeros(sum(numels), dtype=dtype)
    views = [buffer[o : o + n].view_as(p) for o, n, p in zip(offsets, numels, params, strict=True)]
    names = [f"b{index}.p{j}" for j in range(len(params))]
    return GradBucket(index, buffer, names, offsets, numels, params, views, own)


def setup(aggregator: Aggregator, buckets: list[GradBucket]) -> TrafficCounter:
    """Set ``aggregator`` up over the world's gradient communicator; returns the traffic counter it feeds."""
    traffic = TrafficCounter()
    world = topology()
    aggregator.setup(AggregationContext(world.gradients, world, buckets, traffic))
    return traffic


def combine(aggregator: Aggregator, buckets: list[GradBucket], gradients: Sequence[torch.Tensor]) -> None:
    """One round: copy ``gradients`` (flat, one per bucket) into the buckets, start every bucket in order, then
    finish every one in order."""
    for b, gradient in zip(buckets, gradients, strict=True):
        b.buffer.copy_(gradient)
    works = [aggregator.start(b) for b in buckets]
    for b, work in zip(buckets, works, strict=True):
        aggregator.finish(b, work)


def rank_tensor(numel: int, rank: int, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A fixed random flat tensor that differs by ``rank``."""
    generator = torch.Generator().manual_seed(1000 * seed + rank)
    return torch.randn(numel, generator=generator, dtype=torch.float64).to(dtype)


def everyone(numel: int, seed: int = 0, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    """:func:`rank_tensor` of every rank (any rank can compute the others')."""
    return [rank_tensor(numel, r, seed, dtype) for r in range(SIZE)]
