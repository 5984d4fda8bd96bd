"""The digits job in a plain loop (the strategy's gradient reducer, no Trainer): fast enough to train every scheme
at 2 and 4 ranks in a test. The same model, optimizer, schedule and per-rank batch as ``mpistrategy-train``'s
default job (MLP 64-256-10, SGD lr 0.05 momentum 0.9 weight decay 5e-4, cosine over the epochs, 32 per rank)."""

from __future__ import annotations

import torch
from mpi4py import MPI
from torch import nn

from mpistrategy.aggregation import Aggregator
from mpistrategy.comm.topology import topology
from mpistrategy.recipes.data import load_digits_split
from mpistrategy.recipes.models import mlp
from mpistrategy.strategy.reducer import GradientReducer

BATCH = 32


def digits_mlp(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return mlp(64, 256, 1, 10)


def rank_batches(samples: int, epoch: int, seed: int, batch: int = BATCH) -> list[torch.Tensor]:
    """This rank's batches of sample indices in ``epoch``: a seeded shuffle, cut to a multiple of the ranks (every
    rank takes as many steps), dealt round robin (as ``DistributedSampler`` does)."""
    comm = MPI.COMM_WORLD
    order = torch.randperm(samples, generator=torch.Generator().manual_seed(seed + epoch))
    mine = order[: samples // comm.size * comm.size][comm.rank :: comm.size]
    return list(mine.split(batch))


def train_digits(aggregator: Aggregator, epochs: int, seed: int = 0) -> tuple[list[float], int]:
    """Train the digits MLP data parallel with ``aggregator``; the validation accuracy after every epoch, and the
    bytes this rank sent."""
    x, y, x_val, y_val = load_digits_split(0.2, 0, True)
    model = digits_mlp(seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=epochs)
    reducer = GradientReducer(model, aggregator, topology())
    reducer.attach_optimizer(optimizer)
    accuracies = []
    for epoch in range(epochs):
        for indices in rank_batches(len(x), epoch, seed):
            optimizer.zero_grad()
            reducer.prepare(sync=True)
            nn.functional.cross_entropy(model(x[indices]), y[indices]).backward()
            reducer.wait()
            optimizer.step()
        schedule.step()
        with torch.no_grad():
            accuracies.append(float((model(x_val).argmax(1) == y_val).float().mean()))
    reducer.remove()
    return accuracies, reducer.traffic.total
