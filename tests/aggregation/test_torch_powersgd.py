"""PowerSGD against torch's own ``powerSGD_hook`` (torch.distributed over gloo, DDP) at 2 ranks: the same model,
data, batches, optimizer, rank and seeds. The bytes per step agree within 5% and the validation accuracy after the
same epochs within 1 point."""

from __future__ import annotations

import gc

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_powersgd

from mpistrategy.aggregation import PowerSGD
from mpistrategy.recipes.data import load_digits_split
from tests.aggregation.digits import digits_mlp, rank_batches, train_digits
from tests.aggregation.helpers import COMM, SIZE
from tests.strategy.helpers import shared_tmpdir

EPOCHS, RANK_R, START = 10, 1, 10


def _init_gloo(directory: str) -> None:
    """torch.distributed over gloo on this MPI job's ranks, meeting through a file in a shared ``directory``."""
    dist.init_process_group("gloo", init_method=f"file://{directory}/rendezvous", rank=COMM.rank, world_size=SIZE)


def _train_with_torch_hook() -> tuple[float, float, nn.Module]:
    """The digits job under torch's DDP with the PowerSGD hook: final validation accuracy, bytes sent per rank
    (every allreduce's payload: the plain steps' full gradients, then what torch counts after compression), and the
    DDP model (to be released on this thread before the process group goes: its last reference dropped inside a
    gloo callback thread makes that thread join itself and abort)."""
    x, y, x_val, y_val = load_digits_split(0.2, 0, True)
    model = nn.parallel.DistributedDataParallel(digits_mlp(0))
    state = torch_powersgd.PowerSGDState(
        process_group=None,
        matrix_approximation_rank=RANK_R,
        start_powerSGD_iter=START,
        min_compression_rate=2,
        use_error_feedback=True,
        warm_start=True,
        random_seed=0,
    )
    model.register_comm_hook(state, torch_powersgd.powerSGD_hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=EPOCHS)
    for epoch in range(EPOCHS):
        for indices in rank_batches(len(x), epoch, seed=0):
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(x[indices]), y[indices]).backward()
            optimizer.step()
        schedule.step()
    with torch.no_grad():
        accuracy = float((model(x_val).argmax(1) == y_val).float().mean())
    parameters = sum(p.numel() for p in model.parameters())
    sent = 4 * (START * parameters + state.total_numel_after_compression)
    return accuracy, sent, model


@pytest.mark.mpi(ranks=(2,), timeout=240)
def test_powersgd_matches_torchs_hook_in_bytes_and_accuracy() -> None:
    accuracies, ours = train_digits(PowerSGD(rank=RANK_R, start_iter=START, min_compression_rate=2, seed=0), EPOCHS)
    _init_gloo(shared_tmpdir())
    try:
        theirs_accuracy, theirs, model = _train_with_torch_hook()
        dist.barrier()
        del model
        gc.collect()
    finally:
        dist.destroy_process_group()
    steps = EPOCHS * len(rank_batches(1437, 0, 0))
    assert abs(ours - theirs) <= 0.05 * theirs, f"bytes per step: ours {ours / steps:.0f}, torch's {theirs / steps:.0f}"
    assert abs(accuracies[-1] - theirs_accuracy) <= 0.01, f"accuracy: ours {accuracies[-1]}, torch's {theirs_accuracy}"
    assert ours < 0.15 * 4 * steps * sum(p.numel() for p in digits_mlp(0).parameters()), "nothing was compressed"
