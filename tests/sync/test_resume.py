"""Every sync mode stopped by a signal in the middle of its schedule resumes to the same trajectory: each rank's
parameters and optimizer state equal, bit for bit, those of an uninterrupted run (AdamW, SGD with momentum).

The stops fall where a mode holds state between steps: local SGD in the middle of its period and during its
warm-up, DASO with a model average in flight (sent, not yet merged) and at the epoch boundary where its schedule
for the next epoch is decided, gossip after local steps, hierarchical local SGD between two global averages, top-k
compression of the step between nodes with its error-feedback residuals on the node leaders. At 4 ranks the modes
with nodes run as 2 nodes of 2; local SGD and gossip also at 3 ranks (nodes of one rank)."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

from mpistrategy.aggregation import Aggregator, MeanAggregator, TopK
from mpistrategy.strategy.mpi_ad import MPIADStrategy
from mpistrategy.sync import DASO, Gossip, HierarchicalLocalSGD, HierarchicalSync, LocalSGD, SyncMode
from tests.external_job import OUTER_RUN_ONLY, run_mpi_job
from tests.strategy.helpers import SIZE, assert_same_on_all_ranks, flat_parameters, shared_tmpdir, trainer
from tests.strategy.resume import (
    SIGNALS,
    NoisyDropoutModel,
    assert_same_training_state,
    fit_noisy,
    shuffled_loader,
    stop_then_resume,
)

EPOCHS = 3
BATCHES_PER_EPOCH = 8  # per rank

#: name -> the strategy's sync mode and gradient aggregator (new objects per run)
MODES: dict[str, Callable[[], tuple[SyncMode, Aggregator]]] = {
    "local_sgd": lambda: (LocalSGD(period=3, warmup_steps=3), MeanAggregator()),
    "gossip": lambda: (Gossip(graph="ring"), MeanAggregator()),
    "hierarchical_local_sgd": lambda: (HierarchicalLocalSGD(period=4), MeanAggregator()),
    # one epoch of blocking averages, then sends every 4 steps merged 2 steps later, node-local gradient averaging
    # every other step
    "daso": lambda: (
        DASO(warmup_epochs=1, cooldown_epochs=0, global_skip=4, batches_to_wait=2, local_skip=2, downcast=None),
        MeanAggregator(),
    ),
    # error-feedback residuals held by the node leaders only
    "hierarchical+topk": lambda: (HierarchicalSync(), TopK(density=0.1)),
}


def _strategy(mode: str) -> Callable[[], MPIADStrategy]:
    ranks_per_node = 2 if SIZE % 2 == 0 else 1

    def build() -> MPIADStrategy:
        sync, aggregator = MODES[mode]()
        return MPIADStrategy(sync=sync, aggregator=aggregator, ranks_per_node=ranks_per_node)

    return build


@functools.cache
def _uninterrupted(mode: str, optimizer: str) -> tuple:
    model, fit, code = fit_noisy(
        shared_tmpdir(), EPOCHS, BATCHES_PER_EPOCH, strategy=_strategy(mode), optimizer=optimizer
    )
    assert code is None and fit.global_step == EPOCHS * BATCHES_PER_EPOCH
    return model, fit


def _check(mode: str, optimizer: str, signal: str, signal_step: int) -> None:
    """Parameters and optimizer state bit for bit; DASO's whole state too (its schedule, the plateau detector fed
    with the mean over the ranks of each rank's own epoch loss, the counts of averages)."""
    resumed = stop_then_resume(
        shared_tmpdir(),
        SIGNALS[signal],
        signal_step,
        epochs=EPOCHS,
        batches_per_epoch=BATCHES_PER_EPOCH,
        strategy=_strategy(mode),
        optimizer=optimizer,
    )
    reference = _uninterrupted(mode, optimizer)
    assert_same_training_state(resumed, reference)
    if mode == "daso":
        assert asdict(resumed[1].strategy.sync.state) == asdict(reference[1].strategy.sync.state)


@pytest.mark.mpi(ranks=(3, 4), timeout=300)
@pytest.mark.parametrize(
    ("mode", "optimizer", "signal", "signal_step"),
    [
        ("local_sgd", "adamw", "SIGUSR1", 1),  # stops after step 2 of the 3 warm-up steps
        ("local_sgd", "sgd", "SIGTERM", 9),  # stops 1 step after the average of the 9th step
        ("gossip", "adamw", "SIGUSR1", 10),
    ],
)
def test_a_mode_without_nodes_resumes_bit_identical(mode: str, optimizer: str, signal: str, signal_step: int) -> None:
    _check(mode, optimizer, signal, signal_step)


@pytest.mark.mpi(ranks=(4,), timeout=300)
@pytest.mark.parametrize(
    ("mode", "optimizer", "signal", "signal_step"),
    [
        ("daso", "adamw", "SIGUSR1", 9),  # epoch 1, steps 0-1 done: the model sent at step 0 is merged at step 2
        ("daso", "sgd", "SIGTERM", 7),  # the end of warm-up: the next epoch's schedule is not yet decided
        ("hierarchical_local_sgd", "adamw", "SIGTERM", 5),  # 2 steps after the global average of step 3
        ("hierarchical+topk", "sgd", "SIGUSR1", 10),
    ],
)
def test_a_mode_with_nodes_resumes_bit_identical(mode: str, optimizer: str, signal: str, signal_step: int) -> None:
    _check(mode, optimizer, signal, signal_step)


@pytest.mark.mpi(ranks=(3, 4), timeout=300)
@pytest.mark.parametrize("mode", ["local_sgd", "hierarchical+topk"])
def test_a_checkpoint_saved_after_fit_trains_on_as_the_whole_run(mode: str) -> None:
    """``trainer.save_checkpoint`` after ``fit`` returned (the strategy torn down) still holds the sync mode's
    state, every rank's replica (local SGD's last average was a step before the end) and the aggregator's state
    (top-k's residuals), and each rank's random state is restored before the next epoch's dataloader draws from
    it: training on from it for the last epoch gives each rank the parameters and AdamW state of the run of all
    epochs. (Gossip and DASO merge the exchange in flight when fit ends, so their continuation differs.)"""
    directory = shared_tmpdir()
    _, first, code = fit_noisy(directory, EPOCHS - 1, BATCHES_PER_EPOCH, strategy=_strategy(mode))
    assert code is None
    path = os.path.join(directory, "after_fit.ckpt")
    first.save_checkpoint(path)
    model, fit, code = fit_noisy(directory, EPOCHS, BATCHES_PER_EPOCH, strategy=_strategy(mode), ckpt_path=path)
    assert code is None
    assert_same_training_state((model, fit), _uninterrupted(mode, "adamw"))


REPLICA_JOB = Path(__file__).parent / "scripts" / "replica_job.py"


@OUTER_RUN_ONLY
@pytest.mark.parametrize(
    ("mode", "refusal", "refused_by"),
    [
        ("local_sgd", "needs replica 3 of scope 'rank'", "restoring the replicas failed on rank(s) [3]"),
        ("gossip", "the checkpoint holds the exchanges of 3 ranks, but 4 ranks resume", "resume gossip on at most"),
    ],
)
def test_replicas_resumed_on_another_number_of_ranks_are_dropped_with_a_warning_or_refused_on_every_rank(
    tmp_path: Path, mode: str, refusal: str, refused_by: str
) -> None:
    """Local SGD and gossip saved at 3 ranks with their replicas apart: at 2 ranks, ranks 0 and 1 resume their own
    replicas and rank 0 names the replica dropped (gossip builds the 2-rank graph); at 4 ranks, which need a replica
    the checkpoint lacks, every rank raises."""
    directory = str(tmp_path)
    code, output, _ = run_mpi_job(REPLICA_JOB, 3, "save", directory, mode, timeout=200, OMP_NUM_THREADS="1")
    assert code == 0, output[-4000:]
    saved = [torch.load(os.path.join(directory, f"saved-rank{rank}.pt")) for rank in range(3)]
    assert not torch.equal(saved[0], saved[1]), "the replicas did not differ when saved"

    code, output, _ = run_mpi_job(REPLICA_JOB, 2, "load", directory, mode, timeout=200, OMP_NUM_THREADS="1")
    assert code == 0, output[-4000:]
    assert "holds 3 rank replicas and this run has 2 ranks: the replicas of rank(s) 2 are dropped" in output
    for rank in range(2):
        assert torch.equal(torch.load(os.path.join(directory, f"loaded-rank{rank}.pt")), saved[rank])

    code, output, _ = run_mpi_job(REPLICA_JOB, 4, "load", directory, mode, timeout=200, OMP_NUM_THREADS="1")
    assert code != 0
    assert refusal in output
    assert output.count(refused_by) >= 3, output[-4000:]


@pytest.mark.mpi(ranks=(2, 3), timeout=300)
def test_a_checkpoint_read_by_validate_leaves_no_sync_state_to_a_later_fit() -> None:
    """``validate(ckpt_path=...)`` reads the weights only: a later ``fit`` without ``ckpt_path`` starts local SGD
    afresh (its warm-up averages every step, so the replicas stay equal), not from the checkpoint's step count."""
    directory = shared_tmpdir()

    def local_sgd() -> MPIADStrategy:
        return MPIADStrategy(sync=LocalSGD(period=4, warmup_steps=BATCHES_PER_EPOCH))

    _, first, _ = fit_noisy(directory, 1, BATCHES_PER_EPOCH, strategy=local_sgd)  # past the warm-up
    path = os.path.join(directory, "trained.ckpt")
    first.save_checkpoint(path)
    model, later = NoisyDropoutModel(), trainer(strategy=local_sgd(), max_steps=3)
    later.validate(model, shuffled_loader(BATCHES_PER_EPOCH), ckpt_path=path)
    later.fit(model, shuffled_loader(BATCHES_PER_EPOCH))
    assert later.strategy.sync.step == 3
    assert_same_on_all_ranks(flat_parameters(model), "parameters")
