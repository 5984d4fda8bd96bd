"""N ranks with per-rank batch b train exactly like one process with batch N*b (float64, tight tolerance)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from mpistrategy.strategy.mpi_ad import MPIADStrategy
from tests.strategy.helpers import (
    RANK,
    SIZE,
    CountingMean,
    Regressor,
    StridedNet,
    epoch_order,
    flat_parameters,
    loader,
    mlp,
    reference_sgd,
    regression_data,
    trainer,
)

PER_RANK_BATCH = 4
STEPS = 4


@pytest.mark.mpi(ranks=(2, 3), timeout=60)
def test_parameters_with_strides_take_rank_zeros_values_and_train_like_one_process() -> None:
    """A ``channels_last`` convolution and a transposed weight, each rank from its own seed: the Trainer starts
    from rank 0's values and trains like one process on the whole batch (SGD with momentum); the parameters keep
    their strides."""
    data = regression_data(SIZE * PER_RANK_BATCH * STEPS)
    net = StridedNet(seed=30 + RANK)
    model = Regressor(net, lr=0.2, momentum=0.9)
    trainer(max_steps=STEPS).fit(model, loader(data, PER_RANK_BATCH))
    reference = reference_sgd(StridedNet(seed=30), epoch_order(data), SIZE * PER_RANK_BATCH, STEPS, 0.2, 0.9)
    assert net.strided() and reference.strided()
    torch.testing.assert_close(flat_parameters(model), flat_parameters(reference), rtol=1e-12, atol=1e-12)


class CheckpointedTwice(nn.Module):
    """A layer used twice, each time inside an activation checkpoint, between two others (6 features in, 2 out)."""

    def __init__(self, use_reentrant: bool, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.first, self.mid, self.head = nn.Linear(6, 8).double(), nn.Linear(8, 8).double(), nn.Linear(8, 2).double()
        self.use_reentrant = use_reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = torch.tanh(self.first(x))
        for _ in range(2):
            hidden = checkpoint(lambda h: torch.tanh(self.mid(h)), hidden, use_reentrant=self.use_reentrant)
        return self.head(hidden)


@pytest.mark.mpi(ranks=(2, 3), timeout=90)
@pytest.mark.parametrize("use_reentrant", [False, True])
def test_a_layer_in_two_activation_checkpoints(use_reentrant: bool) -> None:
    """Non-reentrant checkpoints: training equals one process on the whole batch. Reentrant ones run a backward
    pass each, so the layer's gradient lands in two parts: every rank raises at the first step, naming the layer's
    parameters and the fix, with the parameters untouched, and the ranks train on together after it."""
    data = regression_data(SIZE * PER_RANK_BATCH * STEPS)
    net = CheckpointedTwice(use_reentrant, seed=40)
    if use_reentrant:
        with pytest.raises(
            RuntimeError, match=r"'net.mid.bias', 'net.mid.weight' got their gradient in more than one part"
        ):
            trainer(max_steps=STEPS).fit(Regressor(net, lr=0.2, momentum=0.9), loader(data, PER_RANK_BATCH))
        net.use_reentrant = False
    model = Regressor(net, lr=0.2, momentum=0.9)
    trainer(max_steps=STEPS).fit(model, loader(data, PER_RANK_BATCH))
    reference = reference_sgd(
        CheckpointedTwice(False, seed=40), epoch_order(data), SIZE * PER_RANK_BATCH, STEPS, 0.2, 0.9
    )
    torch.testing.assert_close(flat_parameters(model), flat_parameters(reference), rtol=1e-12, atol=1e-12)


@pytest.mark.mpi(ranks=(2, 3, 4), timeout=120)
@pytest.mark.parametrize("accumulate", [1, 3])
@pytest.mark.parametrize("clip", [None, 0.05])
@pytest.mark.parametrize("own_bucket_mb", [1.0, 0.0], ids=["flat-buckets", "own-gradient-buckets"])
def test_matches_single_process_large_batch(accumulate: int, clip: float | None, own_bucket_mb: float) -> None:
    samples = SIZE * PER_RANK_BATCH * accumulate * STEPS
    data = regression_data(samples)
    model = Regressor(mlp(seed=1), lr=0.2, momentum=0.9)
    options = {"gradient_clip_val": clip} if clip is not None else {}
    counting = CountingMean()
    strategy = MPIADStrategy(aggregator=counting, own_bucket_mb=own_bucket_mb)
    fit = trainer(strategy=strategy, max_steps=STEPS, accumulate_grad_batches=accumulate, **options)
    fit.fit(model, loader(data, PER_RANK_BATCH))
    assert fit.global_step == STEPS
    # one combination per bucket and optimizer step: the intermediate micro-batches did not communicate
    assert counting.combined == STEPS * counting.buckets

    reference = reference_sgd(
        mlp(seed=1),
        epoch_order(data),
        SIZE * PER_RANK_BATCH,
        STEPS,
        lr=0.2,
        momentum=0.9,
        accumulate=accumulate,
        clip=clip,
    )
    got, want = flat_parameters(model), flat_parameters(reference)
    assert not torch.equal(want, flat_parameters(mlp(seed=1))), "the reference did not train"
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.mpi(ranks=(2, 3), timeout=60)
def test_clipping_is_active_and_matches() -> None:
    """With a tiny clip value the clipped update differs from the unclipped one, and still matches."""
    data = regression_data(SIZE * PER_RANK_BATCH * 2)
    clipped = Regressor(mlp(seed=2), lr=0.5)
    trainer(max_steps=2, gradient_clip_val=1e-3).fit(clipped, loader(data, PER_RANK_BATCH))
    free = reference_sgd(mlp(seed=2), epoch_order(data), SIZE * PER_RANK_BATCH, 2, lr=0.5)
    reference = reference_sgd(mlp(seed=2), epoch_order(data), SIZE * PER_RANK_BATCH, 2, lr=0.5, clip=1e-3)
    assert not torch.allclose(flat_parameters(free), flat_parameters(reference))
    torch.testing.assert_close(flat_parameters(clipped), flat_parameters(reference), rtol=1e-12, atol=1e-12)


class _ClampsAfterBackward(Regressor):
    """Clamps every gradient in ``on_after_backward`` (a nonlinear edit: clamping each rank's own gradient and
    averaging gives another update than clamping the average) and records the first layer's gradient there;
    ``manual``: manual optimization through ``manual_backward``."""

    def __init__(self, manual: bool) -> None:
        super().__init__(mlp(seed=3), lr=0.5)
        self.automatic_optimization = not manual
        self.seen: list[torch.Tensor] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor | None:
        loss = super().training_step(batch, batch_idx)
        if self.automatic_optimization:
            return loss
        optimizer = self.optimizers()
        optimizer.zero_grad()
        self.manual_backward(loss)
        optimizer.step()
        return None

    def on_after_backward(self) -> None:
        self.seen.append(self.net[0].weight.grad.detach().clone())
        for parameter in self.parameters():
            parameter.grad.clamp_(-CLAMP, CLAMP)


CLAMP = 0.02


@pytest.mark.mpi(ranks=(2, 3), timeout=60)
@pytest.mark.parametrize("manual", [False, True], ids=["automatic", "manual"])
def test_on_after_backward_reads_and_edits_the_averaged_gradients(manual: bool) -> None:
    """As under DDP, the gradient sync is finished when backward returns: ``on_after_backward`` sees the average
    (the same on every rank) and its edit is the one a single process with the whole batch makes."""
    steps = 3
    data = regression_data(SIZE * PER_RANK_BATCH * steps)
    model = _ClampsAfterBackward(manual)
    trainer(max_steps=steps).fit(model, loader(data, PER_RANK_BATCH))

    net, seen = mlp(seed=3), []
    optimizer = torch.optim.SGD(net.parameters(), lr=0.5)
    x, y = epoch_order(data).tensors
    whole = SIZE * PER_RANK_BATCH
    for step in range(steps):
        optimizer.zero_grad()
        nn.functional.mse_loss(
            net(x[step * whole : (step + 1) * whole]), y[step * whole : (step + 1) * whole]
        ).backward()
        seen.append(net[0].weight.grad.detach().clone())
        for parameter in net.parameters():
            parameter.grad.clamp_(-CLAMP, CLAMP)
        optimizer.step()
    assert any((g.abs() > CLAMP).any() for g in seen), "the clamp changed nothing"
    for got, want in zip(model.seen, seen, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(flat_parameters(model), flat_parameters(net), rtol=1e-12, atol=1e-12)
