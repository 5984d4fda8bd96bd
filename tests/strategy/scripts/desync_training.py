"""Training in which the last rank goes astray (see tests/strategy/test_diagnosis.py).

argv: framework ("trainer" or "fabric"), case, sync mode. Cases: "skip_backward" (the last rank skips backward and
the optimizer step of batch 1; "skip_backward_sampled": it skips the backward pass only, and reads its batches
through Lightning's DistributedSampler), "extra_step" (rank 0 has one batch more), "uneven_stream" (an
IterableDataset that gives the last rank two batches more per epoch, two epochs), "loader_hang" (the last rank's data
loader blocks in a C call at batch 2), "save_on_rank_zero" (rank 0 alone saves a checkpoint at batch 1),
"gather_on_rank_zero" (rank 0 alone all-gathers its loss at batch 1, before the backward pass), "extra_closure"
(Trainer, automatic optimization: the last rank runs the optimizer's closure once more at batch 1).
``HANG <time>`` marks when the case begins. Healthy cases that must finish: "cycled_stream" (a loader of four
batches and a stream of two that Lightning cycles), "capped_stream" (a stream of four batches capped by
limit_train_batches=10; rank 0 lingers at its last batch), "save_on_every_rank" (every rank saves at batch 1, the
last one 1.5 s after the others). Uneven validation data (Trainer): "uneven_validation" (rank 0 has a validation
batch more; the loss is logged per step with ``sync_dist=True``), "uneven_validation_gather" (the last rank has two
validation batches, the others three; each batch all-gathers its loss; two epochs: the last rank ends its
first validation pass while the others wait in their third gather),
"uneven_validation_per_epoch" (as "uneven_validation", logged per pass only: healthy), "validation_logged_on_one_rank"
(Trainer.validate on even data; only the last rank logs its loss with ``sync_dist=True``, per pass; then every rank
prints VALIDATED and sleeps 30 s). Other stopping conditions
on the last rank (Trainer): "more_epochs" (max_epochs 2, the others 1), "more_steps" (max_steps 6, the others 3,
in the second epoch).
"""

import os
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
SAMPLED = case == "skip_backward_sampled"
BATCHES = SIZE * 4 if SAMPLED else 4 + (case == "extra_step" and RANK == 0)
VAL_BATCHES = {
    "uneven_validation": 3 + (RANK == 0),
    "uneven_validation_per_epoch": 3 + (RANK == 0),
    "validation_logged_on_one_rank": 3,
}.get(case, 2 if RANK == LATE else 3)
CHECKPOINT = os.path.join(os.environ.get("MPISTRATEGY_FLIGHT_DIR", "."), "saved.ckpt")
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
    """Four batches per epoch, six on the last rank under "uneven_stream" (a stream sharded unevenly by hand), two
    under "cycled_stream"."""

    def __iter__(self):
        say(f"HANG {time.time()}")
        length = {"uneven_stream": 4 + 2 * (RANK == LATE), "cycled_stream": 2}.get(case, 4)
        for index in range(length):
            yield torch.full((3,), float(index))


class Model(L.LightningModule):
    """Manual optimization: the last rank can skip a backward pass (the Trainer refuses a ``None`` loss)."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(3, 1)
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx: int) -> None:
        if case == "cycled_stream":
            batch = batch["map"] + batch["stream"]
            time.sleep(0.5)  # the steps after the stream's end outlast the watchdog's poll
        if case == "capped_stream" and RANK == 0 and batch_idx == 2:
            time.sleep(1.5)  # the others reach the stream's end well before rank 0
        optimizer = self.optimizers()
        loss = self.layer(batch).square().mean()
        if case.startswith("skip_backward") and RANK == LATE and batch_idx == 1:
            say(f"HANG {time.time()}")
            if SAMPLED:
                optimizer.step()  # a step without its backward pass: the global step moves on as on the others
            return  # marker: skip
        if batch_idx == 1 and saves():
            self.trainer.save_checkpoint(CHECKPOINT)  # marker: save
        if batch_idx == 1 and gathers():
            self.all_gather(loss)  # marker: gather
        self.manual_backward(loss)  # marker: manual backward
        optimizer.step()
        optimizer.zero_grad()

    def validation_step(self, batch, batch_idx: int) -> None:
        if batch_idx == 0 and not self.trainer.sanity_checking:
            say(f"HANG {time.time()}")
        loss = self.layer(batch).square().mean()
        if case == "uneven_validation_gather":
            self.all_gather(loss)  # marker: validation gather
        elif case == "validation_logged_on_one_rank":
            if RANK == LATE:
                self.log("val_loss", loss, sync_dist=True)
        else:
            per_step = case != "uneven_validation_per_epoch"
            self.log("val_loss", loss, sync_dist=True, on_step=per_step, on_epoch=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def on_train_end(self) -> None:
        if case.startswith("more_") and RANK != LATE:
            say(f"HANG {time.time()}")


class ClosureModel(L.LightningModule):
    """Automatic optimization whose last rank runs the closure (``training_step`` and backward) once more at batch
    1, as LBFGS's line search may where the ranks' losses differ."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(3, 1)

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        return self.layer(batch).square().mean()

    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure=None) -> None:
        if RANK == LATE and batch_idx == 1:
            say(f"HANG {time.time()}")
            optimizer_closure()
        optimizer.step(closure=optimizer_closure)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def saves() -> bool:
    """Whether this rank saves a checkpoint at batch 1 (the last rank 1.5 s after the others)."""
    if case == "save_on_rank_zero" and RANK == 0:
        say(f"HANG {time.time()}")
        return True
    if case == "save_on_every_rank" and RANK == LATE:
        time.sleep(1.5)
    return case == "save_on_every_rank"


def gathers() -> bool:
    """Whether this rank alone all-gathers at batch 1 (rank 0 under "gather_on_rank_zero")."""
    if case == "gather_on_rank_zero" and RANK == 0:
        say(f"HANG {time.time()}")
        return True
    return False


def loader() -> DataLoader | dict[str, DataLoader]:
    if case == "cycled_stream":
        return {"map": DataLoader(Batches(), batch_size=None), "stream": DataLoader(Stream(), batch_size=None)}
    if case in ("uneven_stream", "capped_stream"):
        return DataLoader(Stream(), batch_size=None)
    return DataLoader(Batches(), batch_size=None, shuffle=False)


options = {"sync": SYNCS[sync_name](), "ranks_per_node": 1}
LONGER = case in ("more_epochs", "more_steps") and RANK == LATE  # trains longer than the others
if framework == "trainer":
    trainer = L.Trainer(
        strategy=MPIADStrategy(**options),
        accelerator="cpu",
        max_epochs=2 if case in ("uneven_stream", "uneven_validation_gather", "more_steps") or LONGER else 1,
        max_steps=(6 if LONGER else 5) if case == "more_steps" else -1,
        limit_train_batches=10 if case == "capped_stream" else None,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        use_distributed_sampler=SAMPLED,
    )
    validation = "validation" in case
    validation_data = DataLoader(Batches(), batch_size=None, sampler=range(VAL_BATCHES)) if validation else None
    if case == "validation_logged_on_one_rank":
        trainer.validate(Model(), validation_data)  # marker: validate
        say("VALIDATED")
        time.sleep(30)
    else:
        trainer.fit(ClosureModel() if case == "extra_closure" else Model(), loader(), validation_data)  # marker: fit
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
        if index == 1 and saves():
            fabric.save(CHECKPOINT, {"model": model, "optimizer": optimizer})  # marker: fabric save
        loss = model(batch).square().mean()
        if index == 1 and gathers():
            fabric.all_gather(loss)  # marker: fabric gather
        fabric.backward(loss)  # marker: backward
        optimizer.step()
        optimizer.zero_grad()
say("FINISHED")
