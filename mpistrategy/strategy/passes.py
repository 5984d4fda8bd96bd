"""The ranks' passes over their data, as the Trainer runs them: a training epoch's number of batches, compared on
every rank when the epoch starts, and the evaluation pass each rank is in, recorded for the diagnosis of a
collective mismatch or a stall in it (:func:`mpistrategy.comm.calls.set_evaluation`)."""

from __future__ import annotations

from typing import Any

from mpi4py import MPI
from torch.utils.data import IterableDataset

from mpistrategy.comm.stall_report import uneven_batches
from mpistrategy.strategy import failures
from mpistrategy.strategy.resumable import unwrapped


def check_even_batches(trainer: Any, loaders: Any, comm: MPI.Intracomm) -> None:
    """Collective over ``comm``, at the start of a training epoch: raise on every rank, before any batch, when the
    ranks' loaders (all sized, none over an IterableDataset, whose length is only a hint) give the epoch different
    numbers of batches; the ranks would pair the collectives of different batches and epochs. Streams are left to
    the watchdog, which compares where their data ends."""
    if comm.Get_size() == 1:
        return
    planned = trainer.num_training_batches
    exact = planned != float("inf") and not any(
        isinstance(getattr(unwrapped(loader), "dataset", None), IterableDataset) for loader in training_loaders(loaders)
    )
    counts = comm.allgather(int(planned) if exact else -1)
    if -1 in counts or len(set(counts)) == 1:
        return
    problem = uneven_batches(trainer.current_epoch, dict(enumerate(counts)))
    raise failures.mark_raised_on_every_rank(ValueError(f"mpi_ad: {problem}"))


def evaluation_batches(trainer: Any, stage: str) -> tuple[str, list[float]]:
    """The evaluation pass ``stage`` (``"validation"``, ``"test"``, ``"predict"``) the Trainer begins, as
    ``(stage, batches per dataloader)``: the sanity check is named so, ``inf`` counts a stream."""
    if trainer.sanity_checking:
        return "sanity check", list(trainer.num_sanity_val_batches)
    counts = {"validation": trainer.num_val_batches, "test": trainer.num_test_batches}
    return stage, list(counts.get(stage, trainer.num_predict_batches))


def training_loaders(loaders: Any) -> list[Any]:
    """The loaders of ``trainer.train_dataloader`` (one, or a list, tuple or dict of them, nested), in a list."""
    if isinstance(loaders, dict):
        loaders = list(loaders.values())
    if isinstance(loaders, (list, tuple)):
        return [inner for loader in loaders for inner in training_loaders(loader)]
    return [loaders]
