"""Fabric with the mpi_ad strategy, tiny models and single-process references shared by the Fabric tests."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from lightning.fabric import Fabric
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import mpistrategy  # noqa: F401  (registers "mpi_ad" with Fabric)
from tests.strategy.helpers import COMM, RANK, SIZE, flat_parameters, mlp, regression_data, shared_tmpdir

__all__ = [
    "COMM",
    "RANK",
    "SIZE",
    "OPTIMIZERS",
    "flat_parameters",
    "launched",
    "mlp",
    "rank_batches",
    "reference_training",
    "regression_data",
    "shared_tmpdir",
]

Optimizers = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]

#: stateful optimizers, so that equivalence covers their state too
OPTIMIZERS: dict[str, Optimizers] = {
    "adamw": lambda params: torch.optim.AdamW(params, lr=0.05, weight_decay=0.1),
    "sgd-momentum": lambda params: torch.optim.SGD(params, lr=0.2, momentum=0.9),
}


def launched(strategy: Any = "mpi_ad", **kwargs: Any) -> Fabric:
    """A launched CPU Fabric with ``strategy``."""
    fabric = Fabric(strategy=strategy, accelerator="cpu", **kwargs)
    fabric.launch()
    return fabric


def rank_batches(fabric: Fabric, data: TensorDataset, per_rank: int) -> DataLoader:
    """``data`` through Fabric's distributed sampler, unshuffled: the j-th batches of all ranks together are the
    j-th block of ``world_size * per_rank`` samples."""
    return fabric.setup_dataloaders(DataLoader(data, batch_size=per_rank, shuffle=False))


def reference_training(
    net: nn.Module, data: TensorDataset, block: int, steps: int, make_optimizer: Optimizers, accumulate: int = 1
) -> tuple[nn.Module, torch.optim.Optimizer]:
    """One process: ``steps`` optimizer steps, each over ``accumulate`` consecutive blocks of ``block`` samples
    (mean squared error, divided by ``accumulate``); returns the model and its optimizer."""
    optimizer = make_optimizer(net.parameters())
    x, y = data.tensors
    position = 0
    for _ in range(steps):
        optimizer.zero_grad()
        for _ in range(accumulate):
            xb, yb = x[position : position + block], y[position : position + block]
            position += block
            (nn.functional.mse_loss(net(xb), yb) / accumulate).backward()
        optimizer.step()
    return net, optimizer
