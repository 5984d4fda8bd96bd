"""What a DDP user is told, under mpiexec with mpi_ad: for tests/fabric/test_conventions.py.

Usage: mpiexec -n 2 python conventions.py
"""

from __future__ import annotations

import lightning as L
import torch
from lightning.fabric import Fabric
from torch.utils.data import DataLoader, TensorDataset

import mpistrategy  # noqa: F401  (registers "mpi_ad")

QUIET = dict(logger=False, enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)

L.seed_everything(7)


class Logging(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(3, 1)

    def training_step(self, batch, batch_idx):
        loss = self.net(batch[0]).pow(2).mean()
        self.log("unsynced_epoch_loss", loss, on_step=False, on_epoch=True)
        self.log("synced_epoch_loss", loss, on_step=False, on_epoch=True, sync_dist=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


mismatched = L.Trainer(strategy="mpi_ad", accelerator="cpu", devices=4, max_epochs=1, **QUIET)
print(
    f"MISMATCHED rank={mismatched.global_rank} num_devices={mismatched.num_devices} "
    f"world_size={mismatched.world_size} num_nodes={mismatched.num_nodes}",
    flush=True,
)
default = L.Trainer(strategy="mpi_ad", accelerator="cpu", max_epochs=1, **QUIET)
print(f"DEFAULT rank={default.global_rank} num_devices={default.num_devices}", flush=True)
default.fit(Logging(), DataLoader(TensorDataset(torch.randn(16, 3)), batch_size=4))

fabric = Fabric(strategy="mpi_ad", accelerator="cpu", devices=2, num_nodes=3)
print(f"FABRIC rank={fabric.global_rank} world_size={fabric.world_size}", flush=True)
