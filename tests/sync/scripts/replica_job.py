"""Local SGD's or gossip's per-rank replicas across a change of the number of ranks:
``mpiexec -n N python replica_job.py save|load DIRECTORY local_sgd|gossip``. ``save`` trains 2 epochs (local SGD's
last average 2 steps before the end, so the replicas differ), saves ``DIRECTORY/saved.ckpt`` after fit and each
rank's parameters as ``saved-rank<r>.pt``; ``load`` resumes from that checkpoint and writes each rank's parameters
at the start of training as ``loaded-rank<r>.pt``."""

from __future__ import annotations

import os
import sys
from typing import Any

import lightning.pytorch as L
import torch

from mpistrategy.strategy.mpi_ad import MPIADStrategy
from mpistrategy.sync import Gossip, LocalSGD
from tests.strategy.helpers import RANK, Regressor, flat_parameters, loader, mlp, regression_data, trainer

action, directory, mode = sys.argv[1], sys.argv[2], sys.argv[3]
checkpoint = os.path.join(directory, "saved.ckpt")


class ParametersAtStart(L.Callback):
    def on_train_start(self, trainer: L.Trainer, module: L.LightningModule, *args: Any) -> None:
        torch.save(flat_parameters(module), os.path.join(directory, f"loaded-rank{RANK}.pt"))


model = Regressor(mlp(), lr=0.1, momentum=0.9)
strategy = MPIADStrategy(sync=LocalSGD(period=3) if mode == "local_sgd" else Gossip(graph="ring"))
data = loader(regression_data(24), 2)  # 4 steps per epoch at 3 ranks
if action == "save":
    fit = trainer(strategy=strategy, max_epochs=2)
    fit.fit(model, data)
    fit.save_checkpoint(checkpoint)
    torch.save(flat_parameters(model), os.path.join(directory, f"saved-rank{RANK}.pt"))
else:
    trainer(strategy=strategy, max_epochs=3, callbacks=[ParametersAtStart()]).fit(model, data, ckpt_path=checkpoint)
