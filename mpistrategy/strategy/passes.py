"""The ranks' passes over their data, as the Trainer runs them: a training epoch's number of batches, compared on
every rank when the epoch starts, and the evaluation pass each rank is in, recorded as the process's phase
(:func:`mpistrategy.comm.calls.set_phase`) so that a collective mismatch or a stall in it says how the ranks'
evaluation data differs."""

from __future__ import annotations

from typing import Any, NamedTuple

from mpi4py import MPI
from torch.utils.data import IterableDataset

from mpistrategy.comm import calls
from mpistrategy.comm.checks import agree
from mpistrategy.comm.communicator import world
from mpistrategy.comm.errors import by_rank
from mpistrategy.comm.stall_report import uneven_batches
from mpistrategy.strategy import failures
from mpistrategy.strategy.resumable import unwrapped


def check_even_batches(trainer: Any, loaders: Any, comm: MPI.Intracomm) -> None:
    """Collective over ``comm``, at the start of a training epoch: raise on every rank, before any batch, when the
    ranks' loaders (all sized, none over an IterableDataset, whose length is only a hint) give the epoch different
    numbers of batches; the ranks would pair the collectives of different batches and epochs. Streams are left to
    the watchdog, which compares where their data ends. A rank that ended training instead meets this in
    :func:`check_training_end`'s fingerprint."""
    agree(world(), "training epoch start", (trainer.current_epoch,), "epoch")
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


def check_training_end(trainer: Any) -> None:
    """Collective, when the Trainer ends training: every rank ends it at the same epoch and step. A rank with
    other stopping conditions (``max_epochs``, ``max_steps``) meets, in this fingerprint check, another rank's
    :func:`check_even_batches` at its next epoch (every rank raises a ``CommunicationError`` naming both calls), or
    waits while that rank waits in its gradient sync, which the watchdog reports (ranks waiting in each other's
    calls), instead of both waiting until the stall timeout."""
    agree(world(), "training end", (trainer.current_epoch, trainer.global_step), "epoch, step")


class Evaluation(NamedTuple):
    """An evaluation pass: ``stage`` (``"validation"``, ``"sanity check"``, ``"test"``, ``"predict"``), the batches
    of each dataloader (``inf``: a stream), and whether it has ended."""

    stage: str
    batches: tuple[float, ...]
    ended: bool = False


def begin_evaluation(trainer: Any, stage: str) -> None:
    """The Trainer begins the evaluation pass ``stage`` (``"validation"``, ``"test"``, ``"predict"``; the sanity
    check is named so): this process's phase until :func:`end_evaluation` and the next training batch."""
    if trainer.sanity_checking:
        stage, batches = "sanity check", trainer.num_sanity_val_batches
    else:
        counts = {"validation": trainer.num_val_batches, "test": trainer.num_test_batches}
        batches = counts.get(stage, trainer.num_predict_batches)
    calls.set_phase(Evaluation(stage, tuple(float(count) for count in batches)), uneven_evaluation)


def end_evaluation() -> None:
    """Collective, when the Trainer ends an evaluation pass: the pass stays the phase, ended (a rank with fewer
    batches ends its pass first), and the ranks check that they all ended it. A collective of the pass that only
    some ranks made (``self.log(..., sync_dist=True)`` on one rank) meets this check on the others: every rank
    raises a ``CommunicationError`` naming both calls, instead of the ranks that skipped it going on and leaving
    the others waiting."""
    phase = calls.phase
    if isinstance(phase, Evaluation):
        calls.set_phase(phase._replace(ended=True))
        agree(world(), "end of an evaluation pass", (phase.stage,), "pass")


def leave_evaluation() -> None:
    """Training goes on (or the run failed): no evaluation pass is this process's phase."""
    if isinstance(calls.phase, Evaluation):
        calls.set_phase(None)


def uneven_evaluation(phases: dict[int, Any]) -> str | None:
    """Why ranks in different evaluation passes, or in passes of different numbers of batches (``phases``: each
    rank's :data:`~mpistrategy.comm.calls.phase`), cannot pair their per-batch collectives, and the fix; ``None``
    when no rank is in one or every rank's pass is the same (ended or not)."""
    passes = {rank: found if isinstance(found, Evaluation) else None for rank, found in phases.items()}
    if len({None if found is None else found[:2] for found in passes.values()}) == 1:
        return None
    listing = by_rank(
        {
            rank: "in no validation, test or predict pass" if found is None else _described(found)
            for rank, found in sorted(passes.items())
        }
    )
    return (
        f"The ranks' evaluation data differs ({listing}), so a collective made per batch in validation_step, "
        "test_step or predict_step (self.log(..., sync_dist=True) with on_step=True, self.all_gather, "
        "strategy.reduce) pairs with another batch's, or with the calls after the pass. Give every rank the same "
        "number of batches (keep Lightning's DistributedSampler, use_distributed_sampler=True, or cap the pass with "
        "limit_val_batches / limit_test_batches / limit_predict_batches), or log per pass only (on_step=False, "
        "on_epoch=True: one sync at the end)."
    )


def _described(evaluation: Evaluation) -> str:
    counts = ["a stream" if count == float("inf") else str(int(count)) for count in evaluation.batches]
    if len(counts) == 1:
        shown = f"{evaluation.stage}, {counts[0]} batch{'' if counts[0] == '1' else 'es'}"
    else:
        shown = f"{evaluation.stage}, {' + '.join(counts)} batches ({len(counts)} dataloaders)"
    return f"{shown}, ended" if evaluation.ended else shown


def training_loaders(loaders: Any) -> list[Any]:
    """The loaders of ``trainer.train_dataloader`` (one, or a list, tuple or dict of them, nested), in a list."""
    if isinstance(loaders, dict):
        loaders = list(loaders.values())
    if isinstance(loaders, (list, tuple)):
        return [inner for loader in loaders for inner in training_loaders(loader)]
    return [loaders]
