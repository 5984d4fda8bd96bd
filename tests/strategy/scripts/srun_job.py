"""Train a few steps with Trainer(strategy="mpi_ad") and print what each rank saw (for tests/strategy/test_srun.py)."""

from __future__ import annotations

import json

import lightning.pytorch as L
import torch
from mpi4py import MPI
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import mpistrategy  # noqa: F401


class Job(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(MPI.COMM_WORLD.Get_rank())  # different per rank: the strategy broadcasts rank 0's
        self.net = nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        return nn.functional.mse_loss(self.net(batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


g = torch.Generator().manual_seed(0)
data = TensorDataset(torch.randn(64, 4, generator=g), torch.randn(64, 1, generator=g))
trainer = L.Trainer(
    strategy="mpi_ad",
    accelerator="cpu",
    max_steps=4,
    logger=False,
    enable_progress_bar=False,
    enable_model_summary=False,
    enable_checkpointing=False,
)
model = Job()
trainer.fit(model, DataLoader(data, batch_size=4))
params = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).tolist()
report = {
    "rank": trainer.global_rank,
    "world_size": trainer.world_size,
    "local_rank": trainer.local_rank,
    "environment": type(trainer.strategy.cluster_environment).__name__,
    "global_step": trainer.global_step,
    "params": params,
}
print("REPORT " + json.dumps(report), flush=True)
