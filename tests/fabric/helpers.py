"""Fabric with the mpi_ad strategy for the Fabric tests (models, data and references come from the strategy tests)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from lightning.fabric import Fabric
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import mpistrategy  # noqa: F401  (registers "mpi_ad" with Fabric)
from tests.strategy.helpers import (
    COMM,
    RANK,
    SIZE,
    CountingMean,
    StridedNet,
    flat_parameters,
    mlp,
    reference_training,
    regression_data,
    shared_tmpdir,
)

__all__ = [
    "COMM",
    "RANK",
    "SIZE",
    "OPTIMIZERS",
    "CountingMean",
    "StridedNet",
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
