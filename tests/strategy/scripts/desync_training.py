"""Training in which the last rank goes astray (see tests/strategy/test_diagnosis.py).

argv: framework ("trainer" or "fabric"), case, sync mode. Cases: "skip_backward" (the last rank skips backward and
the optimizer step of batch 1), "extra_step" (rank 0 has one batch more), "uneven_stream" (an IterableDataset that
gives the last rank two batches more per epoch, two epochs), "loader_hang" (the last rank's data loader blocks in a C
call at batch 2). ``HANG <time>`` marks when the case begins.
"""

import sys
import time

import lightning.pytorch as L
import torch
from mpi4py import MPI
from torch import nn
from torch.utils.data import DataLoader, Dataset, IterableDataset

import mpistrategy  # noqa: F401  (registers "mpi_ad")
from mpistrategy.strategy.fabric_mpi_ad import MPIADFabricStrategy
from mpistrategy.strategy.mpi_ad import MPIADStrategy
from mpistrategy.sync import DASO, FlatSync, Gossip, HierarchicalLocalSGD, HierarchicalSync, LocalSGD

framework, case, sync_name = sys.argv[1:4]
RANK, SIZE = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
LATE = SIZE - 1
BATCHES = 4 + (case == "extra_step" and RANK == 0)
SYNCS = {
    "flat": FlatSync,
    "hierarchical": HierarchicalSync,
    "local_sgd": lambda: LocalSGD(period=2),
    "hierarchical_local_sgd": lambda: HierarchicalLocalSGD(period=2),
    "daso": DASO,
    "gossip": Gossip,
}


def say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


class Batches(Dataset):
    def __len__(self) -> int:
        return BATCHES

    def __getitem__(self, index: int) -> torch.Tensor:
        if index == BATCHES - 1 and BATCHES > 4:
            say(f"HANG {time.time()}")
        if case == "loader_hang" and RANK == LATE and index == 2:
            say(f"HANG {time.time()}")
            time.sleep(120)  # marker: loader
        return torch.full((3,), float(index))


class Stream(IterableDataset):
    """Four batches per epoch, six on the last rank (a stream sharded unevenly by hand)."""

    def __iter__(self):
        say(f"HANG {time.time()}")
        for index in range(4 + 2 * (RANK == LATE)):
            yield torch.full((3,), float(index))


class Model(L.LightningModule):
    """Manual optimization: the last rank can skip a backward pass (the Trainer refuses a ``None`` loss)."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(3, 1)
        self.automatic_optimization = False

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        optimizer = self.optimizers()
        loss = self.layer(batch).square().mean()
        if case == "skip_backward" and RANK == LATE and batch_idx == 1:
            say(f"HANG {time.time()}")
            return  # marker: skip
        self.manual_backward(loss)  # marker: manual backward
        optimizer.step()
        optimizer.zero_grad()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def loader() -> DataLoader:
    if case == "uneven_stream":
        return DataLoader(Stream(), batch_size=None)
    return DataLoader(Batches(), batch_size=None, shuffle=False)


options = {"sync": SYNCS[sync_name](), "ranks_per_node": 1}
if framework == "trainer":
    trainer = L.Trainer(
        strategy=MPIADStrategy(**options),
        accelerator="cpu",
        max_epochs=2 if case == "uneven_stream" else 1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        use_distributed_sampler=False,
    )
    trainer.fit(Model(), loader())  # marker: fit
else:
    from lightning.fabric import Fabric

    fabric = Fabric(strategy=MPIADFabricStrategy(**options), accelerator="cpu", devices=1)
    fabric.launch()
    model = nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = fabric.setup(model, optimizer)
    for index, batch in enumerate(loader()):
        if case == "skip_backward" and RANK == LATE and index == 1:
            say(f"HANG {time.time()}")
            continue  # marker: skip
        loss = model(batch).square().mean()
        fabric.backward(loss)  # marker: backward
        optimizer.step()
        optimizer.zero_grad()
say("FINISHED")
