"""Every scheme through ``Trainer(strategy=MPIADStrategy(aggregator=...))``: gradient accumulation (no
communication on intermediate micro-batches), clipping after aggregation, bf16-mixed, own-gradient buckets and
manual optimization keep working, and the ranks stay in sync."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as L
import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

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
from mpistrategy.strategy.mpi_ad import MPIADStrategy
from tests.strategy.helpers import (
    COMM,
    SIZE,
    Regressor,
    assert_same_on_all_ranks,
    flat_parameters,
    loader,
    mlp,
    regression_data,
    trainer,
)

SCHEMES = {
    "fp16": lambda: LowPrecision("float16"),
    "bf16": lambda: LowPrecision("bfloat16"),
    "topk": lambda: TopK(density=0.2),
    "randomk": lambda: RandomK(density=0.2),
    "qsgd": lambda: QSGD(levels=7, block_size=16),
    "minmax": lambda: MinMaxQuantization(bits=4, block_size=16),
    "sign": ScaledSign,
    "majority_vote": MajorityVote,
    "powersgd": lambda: PowerSGD(rank=1, start_iter=2),
}
PER_RANK_BATCH = 4
CLIP = 0.05


def _counting(aggregator):
    """``aggregator``, counting the buckets it starts (in ``aggregator.starts``)."""
    aggregator.starts = 0
    start = aggregator.start

    def counted(bucket):
        aggregator.starts += 1
        return start(bucket)

    aggregator.start = counted
    return aggregator


class _ClippedAfterAggregation(L.Callback):
    """After every optimizer step: the gradients the optimizer used were clipped to ``CLIP`` after they were
    combined, so they are equal on every rank and their norm is at most ``CLIP``."""

    def __init__(self, accumulate: int) -> None:
        self.accumulate = accumulate
        self.checked = 0

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, *args: Any) -> None:
        if (args[-1] + 1) % self.accumulate:
            return
        grads = torch.cat([p.grad.reshape(-1) for p in module.parameters()])
        assert_same_on_all_ranks(grads, "combined, clipped gradients")
        assert torch.linalg.vector_norm(grads) <= CLIP * (1 + 1e-6)
        self.checked += 1


@pytest.mark.mpi(ranks=(2, 3), timeout=120)
@pytest.mark.parametrize("name", list(SCHEMES))
def test_accumulation_and_clipping_after_aggregation(name: str) -> None:
    steps, accumulate = 4, 2
    data = regression_data(SIZE * PER_RANK_BATCH * accumulate * steps)
    model = Regressor(mlp(seed=1), lr=0.2, momentum=0.9)
    aggregator = _counting(SCHEMES[name]())
    check = _ClippedAfterAggregation(accumulate)
    strategy = MPIADStrategy(aggregator=aggregator)
    fit = trainer(
        strategy=strategy,
        max_steps=steps,
        accumulate_grad_batches=accumulate,
        gradient_clip_val=CLIP,
        callbacks=[check],
    )
    fit.fit(model, loader(data, PER_RANK_BATCH))
    assert fit.global_step == steps and check.checked == steps
    # one combination per bucket and optimizer step: the intermediate micro-batches did not communicate
    assert aggregator.starts == steps * len(aggregator.context.buckets)
    parameters = flat_parameters(model)
    assert parameters.isfinite().all() and not torch.equal(parameters, flat_parameters(mlp(seed=1)))
    assert_same_on_all_ranks(parameters, f"{name} parameters")
    assert aggregator.context.traffic.total > 0


@pytest.mark.mpi(ranks=(2, 3), timeout=120)
@pytest.mark.parametrize("name", list(SCHEMES))
def test_bf16_mixed_with_own_gradient_buckets(name: str) -> None:
    data = regression_data(SIZE * PER_RANK_BATCH * 3)
    floats = TensorDataset(*(t.float() for t in data.tensors))
    model = Regressor(mlp(seed=2).float(), lr=0.1, momentum=0.9)
    aggregator = SCHEMES[name]()
    strategy = MPIADStrategy(aggregator=aggregator, own_bucket_mb=0.0)  # every parameter its own bucket
    fit = trainer(strategy=strategy, max_steps=3, precision="bf16-mixed")
    fit.fit(model, loader(floats, PER_RANK_BATCH))
    assert fit.global_step == 3 and all(b.own_gradient for b in aggregator.context.buckets)
    assert_same_on_all_ranks(flat_parameters(model), f"{name} bf16-mixed parameters")
    assert flat_parameters(model).isfinite().all()


class _TwoBackwardsPerStep(L.LightningModule):
    """Manual optimization: two backward passes (two halves of the batch) accumulate into one optimizer step."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.net = net

    def training_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        optimizer = self.optimizers()
        optimizer.zero_grad()
        for half in (slice(0, len(x) // 2), slice(len(x) // 2, len(x))):
            self.manual_backward(nn.functional.mse_loss(self.net(x[half]), y[half]) / 2)
        optimizer.step()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=0.01)


def _manual_fit(aggregator) -> torch.Tensor:
    data = regression_data(SIZE * PER_RANK_BATCH * 3)
    model = _TwoBackwardsPerStep(mlp(seed=3))
    trainer(strategy=MPIADStrategy(aggregator=aggregator), max_steps=3).fit(model, loader(data, PER_RANK_BATCH))
    return flat_parameters(model)


@pytest.mark.mpi(ranks=(2, 3), timeout=120)
@pytest.mark.parametrize("name", [*SCHEMES, "topk-density-1"])
def test_manual_optimization_with_two_backward_passes_per_step(name: str) -> None:
    aggregator = _counting(TopK(density=1.0) if name == "topk-density-1" else SCHEMES[name]())
    parameters = _manual_fit(aggregator)
    assert aggregator.starts == 2 * 3 * len(aggregator.context.buckets), "one combination per backward pass"
    assert_same_on_all_ranks(parameters, f"{name} parameters")
    assert parameters.isfinite().all() and not torch.equal(parameters, flat_parameters(mlp(seed=3)))
    if name == "topk-density-1":  # sends everything: the mean's trajectory, exactly
        assert torch.equal(parameters, _manual_fit(MeanAggregator()))
    COMM.Barrier()
