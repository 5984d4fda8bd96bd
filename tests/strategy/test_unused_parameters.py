"""Parameters that no rank, some ranks or every rank used, and frozen ones: N ranks train as one process does.

The model has (a) a layer ``forward`` never calls, (b) a layer called only for marked samples, all of which land
on rank 0 (a data-dependent branch that the other ranks never take, and that rank 0 takes only in some steps or
micro-batches), and (c) a frozen layer. It is trained through ``Trainer(strategy="mpi_ad")`` with AdamW and with
SGD with momentum, both with weight decay (which would move a parameter given a zero gradient instead of none),
and compared with one process on the concatenated batches (float64): parameters, optimizer state (which
parameters have any, and its values), and the never-used and frozen layers bit for bit. Under local SGD's local
steps each rank must train as one process on its own batches.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import lightning.pytorch as L
import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from mpistrategy.strategy.mpi_ad import MPIADStrategy
from mpistrategy.sync import LocalSGD
from tests.strategy.helpers import RANK, SIZE, epoch_order, loader, regression_data, trainer

FEATURES, HIDDEN, OUTPUTS = 6, 8, 2
PER_RANK_BATCH = 4  # even: a batch's first half on every rank is the first half of one process's batch
STEPS = 4


class Branchy(nn.Module):
    """A trunk and head always used, a frozen layer, a branch for marked samples only, a layer never used."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(7)
        self.trunk = nn.Linear(FEATURES, HIDDEN)
        self.frozen = nn.Linear(FEATURES, HIDDEN).requires_grad_(False)
        self.branch = nn.Linear(HIDDEN, HIDDEN)
        self.never = nn.Linear(HIDDEN, OUTPUTS)
        self.head = nn.Linear(HIDDEN, OUTPUTS)
        self.double()

    def forward(self, x: torch.Tensor, marked: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.trunk(x)) + self.frozen(x)
        if marked.any():  # otherwise the branch is not part of the graph: no gradient at all, not a zero one
            h = torch.where(marked[:, None], h + torch.tanh(self.branch(h)), h)
        return self.head(h)


def _make_optimizer(name: str, params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    if name == "adamw":
        return torch.optim.AdamW(params, lr=0.05, weight_decay=0.1)
    return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=0.1)


def _loss_of(net: Branchy, x: torch.Tensor, y: torch.Tensor, marked: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(net(x, marked), y)


class Automatic(L.LightningModule):
    def __init__(self, optimizer: str) -> None:
        super().__init__()
        self.net = Branchy()
        self.optimizer_name = optimizer

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return _loss_of(self.net, *batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return _make_optimizer(self.optimizer_name, self.net.parameters())


class TwoPasses(Automatic):
    """Manual optimization: one zero_grad, a backward pass per half batch, one step."""

    def __init__(self, optimizer: str, set_to_none: bool) -> None:
        super().__init__(optimizer)
        self.automatic_optimization = False
        self.set_to_none = set_to_none

    def training_step(self, batch: Any, batch_idx: int) -> None:
        optimizer = self.optimizers()
        optimizer.zero_grad(set_to_none=self.set_to_none)
        for half in _halves(len(batch[0])):
            self.manual_backward(_loss_of(self.net, *(t[half] for t in batch)) / 2)
        optimizer.step()


def _halves(size: int) -> tuple[slice, slice]:
    return slice(0, size // 2), slice(size // 2, size)


def _branch_data(batches: int, marked_halves: set[int]) -> TensorDataset:
    """Regression data for ``batches`` batches per rank, with the samples of one process's half batches
    ``marked_halves`` marked where they go to rank 0.

    Lightning's DistributedSampler (shuffle, seed 0, epoch 0) hands rank r the positions r, r + N, r + 2N, ... of
    one permutation (see :func:`epoch_order`); so rank 0 gets position i exactly when i % N == 0, and the first
    (second) halves of every rank's batch j make up the first (second) half of one process's batch j.
    """
    x, y = regression_data(SIZE * PER_RANK_BATCH * batches, FEATURES, OUTPUTS).tensors
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    position = torch.empty_like(perm)
    position[perm] = torch.arange(len(x))
    half = position // (SIZE * PER_RANK_BATCH // 2)
    marked = (position % SIZE == 0) & torch.isin(half, torch.tensor(sorted(marked_halves), dtype=torch.long))
    return TensorDataset(x, y, marked)


def _batches_of(data: TensorDataset, size: int, rank: int | None = None) -> list[tuple[torch.Tensor, ...]]:
    """The batches of ``size`` in the sampler's order: one process's (N * PER_RANK_BATCH), or ``rank``'s own."""
    ordered = epoch_order(data).tensors
    if rank is not None:
        ordered = tuple(t[rank::SIZE] for t in ordered)
    return [tuple(t[start : start + size] for t in ordered) for start in range(0, len(ordered[0]), size)]


def _reference(
    optimizer_name: str,
    batches: list[tuple[torch.Tensor, ...]],
    accumulate: int = 1,
    two_passes: bool = False,
    set_to_none: bool = True,
) -> tuple[Branchy, torch.optim.Optimizer]:
    """One process, plain PyTorch: STEPS optimizer steps of ``accumulate`` consecutive ``batches`` each."""
    net = Branchy()
    optimizer = _make_optimizer(optimizer_name, net.parameters())
    micro_batches = iter(batches)
    for _ in range(STEPS):
        optimizer.zero_grad(set_to_none=set_to_none)
        for _ in range(accumulate):
            x, y, marked = next(micro_batches)
            if two_passes:
                for half in _halves(len(x)):
                    (_loss_of(net, x[half], y[half], marked[half]) / 2).backward()
            else:
                (_loss_of(net, x, y, marked) / accumulate).backward()
        optimizer.step()
    return net, optimizer


def _assert_trained_as_one_process(
    net: Branchy,
    optimizer: torch.optim.Optimizer,
    want_net: Branchy,
    want_optimizer: torch.optim.Optimizer,
    branch_trains: bool = True,
) -> None:
    initial = Branchy()
    for name in ("never.weight", "never.bias", "frozen.weight", "frozen.bias"):
        assert torch.equal(net.get_parameter(name), initial.get_parameter(name)), f"{name} moved"
        assert net.get_parameter(name).grad is None, f"{name} has a gradient"
        assert not optimizer.state[net.get_parameter(name)], f"{name} has optimizer state"
    assert branch_trains != torch.equal(want_net.branch.weight, initial.branch.weight), "branch training"
    for (name, got), want in zip(net.named_parameters(), want_net.parameters(), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12, msg=f"parameter {name}")
        state, want_state = optimizer.state[got], want_optimizer.state[want]
        assert state.keys() == want_state.keys(), f"optimizer state of {name}: {state.keys()} != {want_state.keys()}"
        for key, value in want_state.items():
            torch.testing.assert_close(state[key], value, rtol=1e-12, atol=1e-12, msg=f"{key} of {name}")


#: the branch is used (on rank 0) in steps 0 and 3 and by no rank in steps 1 and 2
STEPS_PATTERN = (1, {0, 6, 7})
#: with two micro-batches per step: only in the first micro-batch, only in the last (synchronised) one, in none,
#: in both
MICRO_BATCHES_PATTERN = (2, {0, 6, 12, 14})


@pytest.mark.mpi(ranks=(1, 2, 3), timeout=180)
@pytest.mark.parametrize(
    ("optimizer", "pattern", "options"),
    [
        ("adamw", STEPS_PATTERN, {}),
        ("sgd", STEPS_PATTERN, {}),
        ("adamw", MICRO_BATCHES_PATTERN, {}),
        ("sgd", MICRO_BATCHES_PATTERN, {}),
        ("adamw", MICRO_BATCHES_PATTERN, {"own_bucket_mb": 0.0}),
        ("sgd", STEPS_PATTERN, {"own_bucket_mb": 0.0}),
        ("adamw", MICRO_BATCHES_PATTERN, {"sync": "hierarchical", "ranks_per_node": 2}),
    ],
    ids=[
        "adamw-steps",
        "sgd-steps",
        "adamw-micro-batches",
        "sgd-micro-batches",
        "adamw-micro-batches-own-gradient-buckets",
        "sgd-steps-own-gradient-buckets",
        "adamw-micro-batches-hierarchical",
    ],
)
def test_unused_partly_used_and_frozen_parameters_train_as_one_process(
    optimizer: str, pattern: tuple[int, set[int]], options: dict[str, Any]
) -> None:
    accumulate, marked_halves = pattern
    data = _branch_data(STEPS * accumulate, marked_halves)
    model = Automatic(optimizer)
    fit = trainer(strategy=MPIADStrategy(**options), max_steps=STEPS, accumulate_grad_batches=accumulate)
    fit.fit(model, loader(data, PER_RANK_BATCH))
    assert fit.global_step == STEPS
    want = _reference(optimizer, _batches_of(data, SIZE * PER_RANK_BATCH), accumulate)
    _assert_trained_as_one_process(model.net, fit.optimizers[0], *want)


class WideWithRankZeroBranch(nn.Module):
    """A trunk and head of width 384 (buckets of 1.2 MB and more, summed by the shared-memory allreduce) and a
    branch that rank ``0`` alone uses, registered last: its bucket is started first."""

    def __init__(self, width: int = 384) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.trunk = nn.Sequential(nn.Linear(FEATURES, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh())
        self.head = nn.Linear(width, OUTPUTS)
        self.branch = nn.Linear(width, OUTPUTS)
        self.double()

    def forward(self, x: torch.Tensor, rank: int) -> torch.Tensor:
        hidden = self.trunk(x)
        return self.head(hidden) + self.branch(hidden) if rank == 0 else self.head(hidden)


class RankZeroBranch(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = WideWithRankZeroBranch()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x, RANK), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return _make_optimizer("adamw", self.net.parameters())


@pytest.mark.mpi(ranks=(2, 3), timeout=180)
def test_a_branch_rank_zero_alone_takes_trains_as_one_process_with_buckets_in_shared_memory() -> None:
    """Rank 0 can start every bucket during backward while the others wait for it to say which parameters it
    used: none of its starts may wait for the others (the shared-memory group and its staging are built with the
    buckets). One process averages each rank's loss on that rank's batch, the branch in rank 0's only."""
    data = regression_data(SIZE * PER_RANK_BATCH * STEPS, FEATURES, OUTPUTS)
    model = RankZeroBranch()
    fit = trainer(strategy=MPIADStrategy(bucket_cap_mb=1.0, first_bucket_cap_mb=0.01), max_steps=STEPS)
    fit.fit(model, loader(data, PER_RANK_BATCH))
    assert fit.global_step == STEPS

    net = WideWithRankZeroBranch()
    optimizer = _make_optimizer("adamw", net.parameters())
    per_rank = [_batches_of(data, PER_RANK_BATCH, rank=rank) for rank in range(SIZE)]
    for step in range(STEPS):
        optimizer.zero_grad()
        loss = sum(nn.functional.mse_loss(net(*per_rank[r][step][:1], r), per_rank[r][step][1]) for r in range(SIZE))
        (loss / SIZE).backward()
        optimizer.step()
    for (name, got), want in zip(model.net.named_parameters(), net.parameters(), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12, msg=f"parameter {name}")
    assert not torch.equal(net.branch.weight, WideWithRankZeroBranch().branch.weight), "the branch did not train"


@pytest.mark.mpi(ranks=(1, 2, 3), timeout=120)
@pytest.mark.parametrize("set_to_none", [True, False])
def test_several_backward_passes_per_step_train_as_one_process(set_to_none: bool) -> None:
    """Manual optimization, two backward passes per step; the branch is used in the first pass only, the second
    only, neither, both. With set_to_none=False a parameter that had a gradient keeps a zero one, which AdamW's
    weight decay and moments act on in one process too."""
    data = _branch_data(STEPS, {0, 3, 6, 7})
    model = TwoPasses("adamw", set_to_none)
    fit = trainer(max_steps=STEPS)
    fit.fit(model, loader(data, PER_RANK_BATCH))
    assert fit.global_step == STEPS
    want = _reference("adamw", _batches_of(data, SIZE * PER_RANK_BATCH), two_passes=True, set_to_none=set_to_none)
    _assert_trained_as_one_process(model.net, fit.optimizers[0], *want)


@pytest.mark.mpi(ranks=(2, 3), timeout=120)
def test_local_steps_train_each_rank_as_one_process_on_its_batches() -> None:
    """Local SGD before its first model average: no gradient communication, so every rank is one process on its
    own batches; rank 0 takes the branch in steps 0 and 3, the other ranks never."""
    data = _branch_data(STEPS, STEPS_PATTERN[1])
    model = Automatic("adamw")
    fit = trainer(strategy=MPIADStrategy(sync=LocalSGD(period=STEPS + 1)), max_steps=STEPS)
    fit.fit(model, loader(data, PER_RANK_BATCH))
    assert fit.global_step == STEPS
    want = _reference("adamw", _batches_of(data, PER_RANK_BATCH, rank=RANK))
    _assert_trained_as_one_process(model.net, fit.optimizers[0], *want, branch_trains=RANK == 0)
    if RANK:
        assert torch.equal(model.net.branch.weight, Branchy().branch.weight), "a branch this rank never took moved"
