"""Tiny models, synthetic data and Trainer defaults shared by the strategy tests."""

from __future__ import annotations

import atexit
import shutil
import tempfile
from pathlib import Path
from typing import Any

import lightning.pytorch as L
import torch
from mpi4py import MPI
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

import mpistrategy  # noqa: F401  (registers "mpi_ad")
from mpistrategy.aggregation import AggregationContext, GradBucket, MeanAggregator, Work

COMM = MPI.COMM_WORLD
RANK = COMM.Get_rank()
SIZE = COMM.Get_size()
#: ``mpiexec -n 3 python ONE_RANK_OPTION_JOB NAME VALUE RANK1_VALUE``: rank 1 alone gives the strategy another value
ONE_RANK_OPTION_JOB = Path(__file__).parent / "scripts" / "one_rank_option_job.py"

QUIET = dict(
    logger=False,
    enable_progress_bar=False,
    enable_model_summary=False,
    enable_checkpointing=False,
    num_sanity_val_steps=0,
    accelerator="cpu",
)


def trainer(**kwargs: Any) -> L.Trainer:
    """A quiet Trainer with the mpi_ad strategy (override anything with kwargs)."""
    options = {**QUIET, "strategy": "mpi_ad", **kwargs}
    return L.Trainer(**options)


def shared_tmpdir() -> str:
    """A temporary directory created by rank 0 and shared by every rank (rank 0 removes it when it exits)."""
    path = None
    if RANK == 0:
        path = tempfile.mkdtemp(prefix="mpistrategy-test-")
        atexit.register(shutil.rmtree, path, ignore_errors=True)
    return COMM.bcast(path, root=0)


def regression_data(samples: int, features: int = 6, outputs: int = 2, seed: int = 0) -> TensorDataset:
    """The same float64 regression data set on every rank."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, features, generator=g, dtype=torch.float64)
    w = torch.randn(features, outputs, generator=g, dtype=torch.float64)
    y = torch.tanh(x @ w) + 0.1 * torch.randn(samples, outputs, generator=g, dtype=torch.float64)
    return TensorDataset(x, y)


def mlp(features: int = 6, hidden: int = 8, outputs: int = 2, seed: int = 0, batchnorm: bool = False) -> nn.Module:
    torch.manual_seed(seed)
    layers: list[nn.Module] = [nn.Linear(features, hidden)]
    if batchnorm:
        layers.append(nn.BatchNorm1d(hidden))
    layers += [nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh(), nn.Linear(hidden, outputs)]
    return nn.Sequential(*layers).double()


class StridedNet(nn.Module):
    """Parameters that are not contiguous: a convolution's weight in ``channels_last`` and a transposed linear
    weight; 6 features in, 2 outputs (float64), as :func:`mlp`."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.conv = nn.Conv2d(2, 3, kernel_size=(1, 2)).double().to(memory_format=torch.channels_last)
        self.weight = nn.Parameter(torch.randn(2, 6, dtype=torch.float64).t())  # shape (6, 2), strides (1, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.conv(x.view(-1, 2, 1, 3))).flatten(1) @ self.weight

    def strided(self) -> bool:
        """Whether both weights still have their strides."""
        return not self.conv.weight.is_contiguous() and not self.weight.is_contiguous()


class Regressor(L.LightningModule):
    """MSE regression with plain SGD (momentum optional)."""

    def __init__(self, net: nn.Module, lr: float = 0.1, momentum: float = 0.0) -> None:
        super().__init__()
        self.net = net
        self.lr = lr
        self.momentum = momentum

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=self.momentum)


def reference_training(
    net: nn.Module,
    data: TensorDataset,
    batch: int,
    steps: int,
    optimizer: torch.optim.Optimizer,
    accumulate: int = 1,
    clip: float | None = None,
) -> nn.Module:
    """One process, plain PyTorch: ``steps`` steps of ``optimizer`` (over ``net``'s parameters) over consecutive
    batches of ``batch`` samples, each step accumulating ``accumulate`` batches (MSE divided by ``accumulate``, as
    Lightning does), optional norm clipping."""
    x, y = data.tensors
    position = 0
    for _ in range(steps):
        optimizer.zero_grad()
        for _ in range(accumulate):
            xb, yb = x[position : position + batch], y[position : position + batch]
            position += batch
            (nn.functional.mse_loss(net(xb), yb) / accumulate).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(net.parameters(), clip)
        optimizer.step()
    return net


def reference_sgd(
    net: nn.Module,
    data: TensorDataset,
    batch: int,
    steps: int,
    lr: float,
    momentum: float = 0.0,
    accumulate: int = 1,
    clip: float | None = None,
) -> nn.Module:
    """:func:`reference_training` with plain SGD (momentum optional)."""
    optimizer = torch.optim.SGD(net.parameters(), lr=lr, momentum=momentum)
    return reference_training(net, data, batch, steps, optimizer, accumulate, clip)


class CountingMean(MeanAggregator):
    """The default mean, counting how many bucket combinations it started."""

    combined = 0

    def setup(self, context: AggregationContext) -> None:
        super().setup(context)
        self.buckets = len(context.buckets)

    def start(self, bucket: GradBucket) -> Work:
        self.combined += 1
        return super().start(bucket)


def epoch_order(data: TensorDataset, epoch: int = 0, seed: int = 0) -> TensorDataset:
    """``data`` in the order Lightning's automatic ``DistributedSampler`` (shuffle=True, seed 0) visits it.

    Rank r of N gets ``perm[r::N]``, so the union of every rank's j-th batch of b samples is the j-th block of
    N*b samples of ``perm``: the batch one process with batch N*b sees.
    """
    perm = torch.randperm(len(data), generator=torch.Generator().manual_seed(seed + epoch))
    return TensorDataset(*(t[perm] for t in data.tensors))


def flat_parameters(module: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()])


def assert_same_on_all_ranks(tensor: torch.Tensor, what: str = "tensor") -> None:
    everyone = COMM.allgather(tensor.detach().cpu())
    for rank, other in enumerate(everyone):
        assert torch.equal(other, everyone[0]), f"{what} differs between rank 0 and rank {rank}"


class IndexDataset(Dataset):
    """Item i is ``(i as float64 feature vector, i)``: lets tests see which samples a rank got."""

    def __init__(self, size: int, features: int = 4) -> None:
        self.size = size
        self.features = features

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return torch.full((self.features,), float(index), dtype=torch.float64), index


def loader(dataset: Dataset, batch_size: int, **kwargs: Any) -> DataLoader:
    return DataLoader(dataset, batch_size=batch_size, shuffle=False, **kwargs)
