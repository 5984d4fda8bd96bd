"""A deep MLP with a frozen layer, a parameter no rank uses and a head only rank 0 uses, trained with AdamW in two
parameter groups, and what a run of it leaves behind: parameters, optimizer state, memory."""

from __future__ import annotations

import copy
import functools
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as L
import torch
from torch import nn
from torch.utils.data import TensorDataset

from mpistrategy.strategy.mpi_ad import MPIADStrategy
from tests.strategy.helpers import RANK, SIZE, loader, trainer

FEATURES, WIDTH, LAYERS = 16, 64, 12
BATCH = 4
BUCKET_CAP_MB = 0.05


class DeepNet(L.LightningModule):
    """``LAYERS`` tanh layers of ``WIDTH``; AdamW with weight decay on the weights only (two groups, two learning
    rates). Every gradient's arrival is probed for the gradient memory the rank holds then."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(FEATURES, WIDTH), *(nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)))
        self.frozen = nn.Linear(WIDTH, WIDTH).requires_grad_(False)
        self.out = nn.Linear(WIDTH, 2)
        self.unused = nn.Linear(WIDTH, 2)
        self.rank_zero_head = nn.Linear(WIDTH, 2)
        self.peak_grad_bytes = 0
        for param in self.parameters():
            if param.requires_grad:
                param.register_post_accumulate_grad_hook(self._probe)

    def _probe(self, _: torch.Tensor) -> None:
        engine = getattr(self._trainer.strategy, "_engine", None) if self._trainer is not None else None
        if engine is not None:
            self.peak_grad_bytes = max(self.peak_grad_bytes, engine.memory().grads)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        hidden = self.frozen(torch.tanh(self.body(x)))
        loss = nn.functional.mse_loss(self.out(hidden), y)
        if self.global_rank == 0:
            loss = loss + self.rank_zero_head(hidden).pow(2).mean()
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        weights = [p for name, p in self.named_parameters() if name.endswith("weight")]
        biases = [p for name, p in self.named_parameters() if name.endswith("bias")]
        return torch.optim.AdamW(
            [{"params": weights, "weight_decay": 0.1}, {"params": biases, "weight_decay": 0.0, "lr": 5e-4}], lr=1e-3
        )


def data(steps: int, accumulate: int) -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(SIZE * BATCH * steps * accumulate, FEATURES, generator=g)
    return TensorDataset(x, torch.sin(x[:, :2] * 2) + 0.1 * torch.randn(len(x), 2, generator=g))


def parameter_vector(module: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()])


@dataclass
class Run:
    """What a fit leaves: the parameters, the whole optimizer state (on the last rank), the memory each rank
    holds."""

    params: torch.Tensor
    optimizer_state: dict[str, Any] | None
    optimizer_state_bytes: int
    grad_bytes_after_backward: int
    peak_grad_bytes: int
    shards: int  # how many ranks split the state this rank holds a shard of (1: not sharded)


@functools.cache
def fit(shard: str | None, sync: str = "flat", steps: int = 20, accumulate: int = 2, clip: float = 0.5) -> Run:
    """Fit :class:`DeepNet` with ``shard`` under ``sync`` (virtual nodes of 2 ranks) with clipping and accumulation."""
    model = DeepNet()
    strategy = MPIADStrategy(shard=shard, sync=sync, ranks_per_node=2, bucket_cap_mb=BUCKET_CAP_MB)
    probe = _MemoryAtStep()
    fit = trainer(
        strategy=strategy,
        max_steps=steps,
        accumulate_grad_batches=accumulate,
        gradient_clip_val=clip,
        callbacks=[probe],
    )
    fit.fit(model, loader(data(steps, accumulate), BATCH))
    # the whole state on the last rank (under hierarchical sync, in the second node's shard group)
    state = copy.deepcopy(strategy.consolidated_optimizer_state(fit.optimizers[0], to=SIZE - 1))
    assert (state is not None) == (RANK == SIZE - 1), f"rank {RANK} got a state: {state is not None}"
    shards = 1 if strategy._sharding is None else strategy._sharding.group.size
    return Run(
        parameter_vector(model), state, probe.optimizer_state_bytes, probe.grad_bytes, model.peak_grad_bytes, shards
    )


class _MemoryAtStep(L.Callback):
    """The optimizer state and gradient bytes this rank holds just before the last optimizer step."""

    optimizer_state_bytes = grad_bytes = 0

    def on_before_optimizer_step(self, trainer: L.Trainer, *args: Any) -> None:
        report = trainer.strategy._engine.memory()
        self.grad_bytes = report.grads
        self.optimizer_state_bytes = max(self.optimizer_state_bytes, report.optimizer_state)
