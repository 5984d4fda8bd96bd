"""Rank 1 alone adds a parameter group to its sharded AdamW at the second training step:
``mpiexec -n 3 python group_on_one_rank_job.py SHARD`` (``optimizer`` or ``gradients``)."""

from __future__ import annotations

import sys

import torch
from mpi4py import MPI

from mpistrategy.strategy.mpi_ad import MPIADStrategy
from tests.strategy.helpers import Regressor, loader, mlp, regression_data, trainer


class _GroupOnRankOne(Regressor):
    def __init__(self) -> None:
        super().__init__(mlp())
        self.extra = torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))

    def training_step(self, batch, batch_idx):
        if batch_idx == 1 and MPI.COMM_WORLD.Get_rank() == 1:
            self.optimizers().optimizer.add_param_group({"params": [self.extra], "lr": 0.01})
        return super().training_step(batch, batch_idx)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.net.parameters())


trainer(strategy=MPIADStrategy(shard=sys.argv[1]), max_steps=3).fit(_GroupOnRankOne(), loader(regression_data(24), 4))
print("FINISHED", flush=True)
