"""SyncBatchNorm on N ranks equals BatchNorm on one process with the concatenated batch: outputs, gradients
(through the differentiable allgather) and running statistics, also for data whose mean is large against its
spread; a bad input on one rank raises on every rank; and Trainer(sync_batchnorm=True) uses it."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as L
import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from mpistrategy import CommunicationError
from mpistrategy.nn import SyncBatchNorm
from mpistrategy.strategy import MPIADStrategy
from tests.strategy.helpers import (
    COMM,
    RANK,
    SIZE,
    Regressor,
    epoch_order,
    flat_parameters,
    loader,
    mlp,
    regression_data,
    trainer,
)


def _split(total: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    start = sum(sizes[:RANK])
    return total[start : start + sizes[RANK]]


@pytest.mark.mpi(ranks=(2, 3, 4), timeout=60)
@pytest.mark.parametrize("shape", [(6,), (3, 4, 5)])
def test_forward_backward_and_running_stats_match_full_batch(shape: tuple[int, ...]) -> None:
    sizes = [r + 2 for r in range(SIZE)]  # uneven batches
    g = torch.Generator().manual_seed(11)
    full_x = torch.randn(sum(sizes), *shape, generator=g, dtype=torch.float64) * 3 + 1
    full_w = torch.randn(sum(sizes), *shape, generator=g, dtype=torch.float64)
    bn_type = nn.BatchNorm1d if len(shape) == 1 else nn.BatchNorm2d
    torch.manual_seed(0)
    reference = bn_type(shape[0], momentum=0.3).double()
    with torch.no_grad():
        reference.weight.uniform_(0.5, 1.5)
        reference.bias.uniform_(-0.5, 0.5)
    sync = SyncBatchNorm.convert_sync_batchnorm(bn_type(shape[0], momentum=0.3).double())
    sync.load_state_dict(reference.state_dict())
    assert isinstance(sync, SyncBatchNorm)

    x_full = full_x.clone().requires_grad_(True)
    (reference(x_full) * full_w).sum().backward()

    x = _split(full_x, sizes).clone().requires_grad_(True)
    out = sync(x)
    torch.testing.assert_close(out, _split(reference(full_x.detach()), sizes).detach(), rtol=1e-10, atol=1e-10)
    (out * _split(full_w, sizes)).sum().backward()  # rank r's own loss; the global objective is their sum
    torch.testing.assert_close(x.grad, _split(x_full.grad, sizes), rtol=1e-10, atol=1e-10)
    weight_grad = sum(COMM.allgather(sync.weight.grad))
    bias_grad = sum(COMM.allgather(sync.bias.grad))
    torch.testing.assert_close(weight_grad, reference.weight.grad, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(bias_grad, reference.bias.grad, rtol=1e-10, atol=1e-10)
    # the reference ran forward twice in training mode; run ours once more on the same data
    sync(_split(full_x, sizes))
    torch.testing.assert_close(sync.running_mean, reference.running_mean, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(sync.running_var, reference.running_var, rtol=1e-12, atol=1e-12)
    assert int(sync.num_batches_tracked) == int(reference.num_batches_tracked) == 2

    sync.eval()
    reference.eval()
    torch.testing.assert_close(sync(x.detach()), reference(x.detach()))
    reverted = SyncBatchNorm.revert_sync_batchnorm(sync)
    assert type(reverted) is bn_type and reverted.weight is sync.weight


@pytest.mark.mpi(ranks=(1, 2, 3), timeout=60)
@pytest.mark.parametrize("offset", [1e6, 1e8])
def test_large_mean_keeps_precision(offset: float) -> None:
    # std 1 around a mean of 1e6 or 1e8: E[x^2] - mean^2 would lose 3-4 or all 16 digits of the variance
    sizes = [7, 2, 0][:SIZE]  # uneven, and at 3 ranks one rank with an empty batch
    g = torch.Generator().manual_seed(3)
    full_x = torch.randn(sum(sizes), 3, generator=g, dtype=torch.float64) + offset
    full_w = torch.randn(sum(sizes), 3, generator=g, dtype=torch.float64)
    reference = nn.BatchNorm1d(3, momentum=0.5, dtype=torch.float64)
    sync = SyncBatchNorm(3, momentum=0.5, dtype=torch.float64)
    with torch.no_grad():
        reference.weight.copy_(torch.tensor([0.5, 1.0, 2.0]))
        reference.bias.copy_(torch.tensor([-1.0, 0.0, 1.0]))
    sync.load_state_dict(reference.state_dict())

    x_full = full_x.clone().requires_grad_(True)
    expected = reference(x_full)
    (expected * full_w).sum().backward()
    x = _split(full_x, sizes).clone().requires_grad_(True)
    out = sync(x)
    (out * _split(full_w, sizes)).sum().backward()

    tight = {"rtol": 1e-6, "atol": 1e-6}
    torch.testing.assert_close(out, _split(expected.detach(), sizes), **tight)
    torch.testing.assert_close(x.grad, _split(x_full.grad, sizes), **tight)
    torch.testing.assert_close(sum(COMM.allgather(sync.weight.grad)), reference.weight.grad, **tight)
    torch.testing.assert_close(sum(COMM.allgather(sync.bias.grad)), reference.bias.grad, **tight)
    torch.testing.assert_close(sync.running_mean, reference.running_mean, rtol=1e-12, atol=0)
    torch.testing.assert_close(sync.running_var, reference.running_var, **tight)
    # every rank combined the same gathered statistics alike: the same bits everywhere
    assert all(torch.equal(var, sync.running_var) for var in COMM.allgather(sync.running_var))


@pytest.mark.mpi(ranks=(2, 3), timeout=30)
@pytest.mark.parametrize(
    ("bad_shape", "problem"),
    [((2, 4, 5), r"expected 3 channels, got input of shape \(2, 4, 5\)"), ((3,), "at least 2 dimensions")],
    ids=["channels", "dimensions"],
)
def test_bad_input_on_one_rank_raises_on_every_rank(bad_shape: tuple[int, ...], problem: str) -> None:
    culprit = 1
    sync = SyncBatchNorm(3, dtype=torch.float64)
    before = {key: value.clone() for key, value in sync.state_dict().items()}
    x = torch.randn(bad_shape if RANK == culprit else (2, 3, 5), dtype=torch.float64)
    if RANK == culprit:
        with pytest.raises(ValueError, match=problem):
            sync(x)
    else:
        with pytest.raises(CommunicationError, match=f"rank {culprit} failed the argument checks.*{problem}"):
            sync(x)
    for key, value in sync.state_dict().items():  # no rank counted the batch or moved its running statistics
        assert torch.equal(value, before[key]), key

    # the ranks are still in step: a correct forward on every rank matches batch norm on the whole batch
    g = torch.Generator().manual_seed(5)
    full_x = torch.randn(2 * SIZE, 3, 4, generator=g, dtype=torch.float64) * 2 + 3
    reference = nn.BatchNorm1d(3, dtype=torch.float64)
    torch.testing.assert_close(sync(_split(full_x, [2] * SIZE)), _split(reference(full_x), [2] * SIZE).detach())
    torch.testing.assert_close(sync.running_var, reference.running_var)
    assert int(sync.num_batches_tracked) == 1


class _Watch(L.Callback):
    def __init__(self) -> None:
        self.types: set[type] = set()

    def on_train_batch_start(self, trainer: L.Trainer, module: L.LightningModule, *args: Any) -> None:
        self.types |= {type(m) for m in module.modules()}


@pytest.mark.mpi(ranks=(2, 3), timeout=60)
def test_trainer_sync_batchnorm_matches_single_process() -> None:
    steps, per_rank = 3, 4
    data = regression_data(SIZE * per_rank * steps)
    model = Regressor(mlp(seed=5, batchnorm=True), lr=0.2)
    watch = _Watch()
    trainer(max_steps=steps, sync_batchnorm=True, callbacks=[watch]).fit(model, loader(data, per_rank))
    assert SyncBatchNorm in watch.types and nn.BatchNorm1d not in watch.types
    assert type(model.net[1]) is nn.BatchNorm1d, "SyncBatchNorm was not reverted after fit"

    reference = mlp(seed=5, batchnorm=True)
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.2)
    x, y = epoch_order(data).tensors
    for step in range(steps):
        block = slice(step * SIZE * per_rank, (step + 1) * SIZE * per_rank)
        optimizer.zero_grad()
        nn.functional.mse_loss(reference(x[block]), y[block]).backward()
        optimizer.step()
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(model.net.state_dict()[key], value, rtol=1e-10, atol=1e-12, msg=key)


class _BuffersAtEvaluation(L.Callback):
    """Every rank's BatchNorm running statistics when each validation and test pass begins."""

    def __init__(self) -> None:
        self.seen: list[list[torch.Tensor]] = []

    def on_validation_epoch_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self.seen.append(COMM.allgather(torch.cat([module.net[1].running_mean, module.net[1].running_var])))

    on_test_epoch_start = on_validation_epoch_start


class _Validated(Regressor):
    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val/loss", nn.functional.mse_loss(self.net(batch[0]), batch[1]), sync_dist=True)

    test_step = validation_step


@pytest.mark.mpi(ranks=(2, 3), timeout=60)
@pytest.mark.parametrize("sync_name", ["flat", "hierarchical"])
def test_plain_batchnorm_is_evaluated_with_rank_zeros_running_statistics_on_every_rank(sync_name: str) -> None:
    """Without sync_batchnorm each rank's running statistics follow its own batches in training; every validation
    and test pass begins with rank 0's on every rank (as DDP broadcasts them), which a checkpoint keeps too."""
    data = regression_data(SIZE * 4 * 6, seed=3)
    model = _Validated(mlp(seed=5, batchnorm=True), lr=0.2)
    watch = _BuffersAtEvaluation()
    strategy = MPIADStrategy(sync=sync_name)
    run = trainer(max_epochs=2, strategy=strategy, callbacks=[watch], num_sanity_val_steps=0, limit_val_batches=2)
    run.fit(model, loader(data, 4), loader(data, 4))
    run.test(model, loader(data, 4))
    assert len(watch.seen) == 3  # two validation passes and the test
    for ranks in watch.seen:
        assert all(torch.equal(stats, ranks[0]) for stats in ranks), "ranks evaluate different running statistics"
    assert not torch.equal(watch.seen[0][0], watch.seen[1][0])  # the statistics moved in training


class RunningNormaliser(nn.Module):
    """Subtracts a running mean of its inputs that training forward passes update and read (a buffer)."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.layer = nn.Linear(6, 2).double()
        self.register_buffer("mean", torch.zeros(6, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            with torch.no_grad():
                self.mean.mul_(0.5).add_(0.5 * x.mean(0))
        return self.layer(x - self.mean)


def _trained_with_rank_zeros_buffers(seed: int, data: TensorDataset, per_rank: int, steps: int) -> nn.Module:
    """One process: at every step each rank's batch passes through the model with the buffers rank 0 had after
    its previous forward pass (DDP's broadcast before each forward), then SGD on the mean of the ranks' losses."""
    model = RunningNormaliser(seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    x, y = epoch_order(data).tensors
    for step in range(steps):
        block = slice(step * SIZE * per_rank, (step + 1) * SIZE * per_rank)
        shared, after, losses = model.mean.clone(), [], []
        for rank in range(SIZE):
            model.mean.copy_(shared)
            losses.append(nn.functional.mse_loss(model(x[block][rank::SIZE]), y[block][rank::SIZE]))
            after.append(model.mean.clone())
        model.mean.copy_(after[0])
        optimizer.zero_grad()
        (sum(losses) / SIZE).backward()
        optimizer.step()
    return model


@pytest.mark.mpi(ranks=(2, 3), timeout=60)
def test_a_buffer_the_training_forward_reads_is_rank_zeros_at_every_batch() -> None:
    """A running normaliser, whose training forward updates and reads a buffer: before every training batch each
    rank gets rank 0's buffers, as under DDP, so training equals DDP's (one process replaying it, float64)."""
    per_rank, steps = 4, 5
    data = regression_data(SIZE * per_rank * steps, seed=6)
    model = Regressor(RunningNormaliser(seed=8 + RANK), lr=0.2, momentum=0.9)
    trainer(max_steps=steps).fit(model, loader(data, per_rank))
    reference = _trained_with_rank_zeros_buffers(8, data, per_rank, steps)
    torch.testing.assert_close(flat_parameters(model), flat_parameters(reference), rtol=1e-12, atol=1e-12)
    if RANK == 0:
        torch.testing.assert_close(model.net.mean, reference.mean, rtol=1e-12, atol=1e-12)
