"""What the modes average besides the weights: every parameter group and the BatchNorm running statistics; the
Trainer features they must keep working (bf16-mixed, gradient accumulation, clipping); and what a fit leaves
behind: no communicator (MPI's context ids are finite), a checkpoint still saved after it.

4 ranks as 2 nodes of 2. The model has BatchNorm and two parameter groups with their own learning rates; each rank
sees its own data, so replicas drift apart between averages."""

from __future__ import annotations

import lightning.pytorch as L
import pytest
import torch
from mpi4py import MPI
from torch import nn

from mpistrategy.aggregation import TopK
from mpistrategy.comm.shm import shared_memory
from mpistrategy.comm.topology import topology
from mpistrategy.comm.traffic import TrafficCounter
from mpistrategy.strategy.mpi_ad import MPIADStrategy
from mpistrategy.sync import DASO, Gossip, HierarchicalLocalSGD, LocalSGD
from mpistrategy.sync.averaging import ModelAverager
from tests.mpi_resources import free_context_ids
from tests.strategy.helpers import (
    COMM,
    RANK,
    SIZE,
    assert_same_on_all_ranks,
    loader,
    regression_data,
    shared_tmpdir,
    trainer,
)

PER_RANK_BATCH = 4


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 2))


class TwoGroups(L.LightningModule):
    """SGD with momentum, the first layer in a group of its own (another learning rate)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = _model()

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x.float()), y.float())

    def configure_optimizers(self):
        first, rest = list(self.net[0].parameters()), [p for layer in self.net[1:] for p in layer.parameters()]
        return torch.optim.SGD([{"params": first, "lr": 0.02}, {"params": rest}], lr=0.05, momentum=0.9)


def _state(module: nn.Module) -> torch.Tensor:
    """Every parameter and floating-point buffer, flat."""
    tensors = [p.detach() for p in module.parameters()]
    tensors += [b for b in module.buffers() if b.dtype.is_floating_point]
    return torch.cat([t.reshape(-1).double() for t in tensors])


@pytest.mark.mpi(ranks=(4,), timeout=240)
@pytest.mark.parametrize("route", ["world", "nodes"])
def test_the_average_covers_parameters_and_batchnorm_statistics(route: str) -> None:
    module = _model()
    torch.manual_seed(10 + RANK)
    with torch.no_grad():
        for tensor in [*module.parameters(), module[1].running_mean, module[1].running_var]:
            tensor.copy_(torch.rand_like(tensor) + 0.5)
    mine = _state(module)
    expected = sum(COMM.allgather(mine)) / SIZE
    averager = ModelAverager(module, topology(ranks_per_node=2), TrafficCounter(), route)
    averager.assign(averager.average())
    torch.testing.assert_close(_state(module), expected, rtol=1e-6, atol=1e-6)
    assert_same_on_all_ranks(_state(module), "averaged state")


def _randomized(module: nn.Module, seed: int) -> None:
    torch.manual_seed(seed)
    with torch.no_grad():
        for tensor in [*module.parameters(), module[1].running_mean, module[1].running_var]:
            tensor.copy_(torch.rand_like(tensor) + 0.5)


@pytest.mark.mpi(ranks=(3, 4), timeout=240)
def test_node_route_in_shared_memory_equals_mpi_and_keeps_two_averages_in_flight() -> None:
    """The ``"nodes"`` route with its buffers in the node's shared memory (the mean read in place off the leader)
    gives MPI's result (node sum and broadcast over MPI) in float32 and bfloat16 on the wire; two averages may be
    in flight, a third is refused on every rank; ``close()`` frees the memory and the communicators, and a new
    averager works.
    3 ranks are a node of 2 and a node of 1."""
    nodes = topology(ranks_per_node=2)
    module = _model()
    results = {}
    for mode in ("off", "on"):
        with shared_memory(mode):
            averager = ModelAverager(module, nodes, TrafficCounter(), "nodes")
            for wire in (None, torch.bfloat16):
                _randomized(module, 10 + RANK)
                results[mode, wire] = _state_of(averager.average(wire))
            averager.close()
    expected = sum(COMM.allgather(_state(module).clone())) / SIZE
    for wire in (None, torch.bfloat16):
        assert torch.equal(results["on", wire], results["off", wire]), f"wire {wire}: shared memory differs from MPI"
        assert_same_on_all_ranks(results["on", wire], f"mean with wire {wire}")
    torch.testing.assert_close(results["on", None], expected, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(results["on", torch.bfloat16], expected, rtol=1e-2, atol=1e-2)

    averager = ModelAverager(module, nodes, TrafficCounter(), "nodes")
    _randomized(module, 20 + RANK)
    first_expected = sum(COMM.allgather(_state(module).clone())) / SIZE
    first = averager.start()
    _randomized(module, 30 + RANK)
    second_expected = sum(COMM.allgather(_state(module).clone())) / SIZE
    second = averager.start()
    with pytest.raises(RuntimeError, match="two averages are still in flight"):
        averager.start()
    torch.testing.assert_close(_state_of(first.result()), first_expected, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(_state_of(second.result()), second_expected, rtol=1e-6, atol=1e-6)
    first = second = None
    averager.close()
    assert averager._shared is None, "close() kept the shared memory"
    assert averager.node is not None and averager.node.comm == MPI.COMM_NULL, "close() kept the communicators"
    again = ModelAverager(module, nodes, TrafficCounter(), "nodes")  # what a later fit builds
    again.assign(again.average())
    torch.testing.assert_close(_state(module), second_expected.float().double(), rtol=1e-6, atol=1e-6)
    again.close()


def _state_of(flats: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([flat.double() for flat in flats])


MODES = {
    "local_sgd": lambda: LocalSGD(period=3, warmup_steps=3),
    "hierarchical_local_sgd": lambda: HierarchicalLocalSGD(period=3),
    "daso": lambda: DASO(warmup_epochs=0, cooldown_epochs=0, global_skip=2, batches_to_wait=1),
    "gossip": lambda: Gossip(graph="complete"),
}


@pytest.mark.mpi(ranks=(4,), timeout=240)
@pytest.mark.parametrize("mode", sorted(MODES))
def test_bf16_mixed_accumulation_and_clipping_end_on_one_model(mode: str) -> None:
    """12 micro-batches, 2 per step: 6 steps; each mode averages after the last one (local SGD after 3 warm-up
    steps and a period of 3, hierarchical local SGD after two periods of 3, DASO's blocking last step, gossip's
    complete graph at the end of fit), so every rank ends with the same parameters and BatchNorm statistics, which
    training moved. Gossip mixes ``x_i + sum_j w_ij (x_j - x_i)`` on each rank, equal to rounding only."""
    model = TwoGroups()
    before = _state(model.net)
    data = regression_data(SIZE * PER_RANK_BATCH * 12, seed=7)
    fit = trainer(
        strategy=MPIADStrategy(sync=MODES[mode](), ranks_per_node=2),
        precision="bf16-mixed",
        accumulate_grad_batches=2,
        gradient_clip_val=0.5,
        max_epochs=1,
    )
    fit.fit(model, loader(data, PER_RANK_BATCH))
    assert fit.global_step == 6
    after = _state(model.net)
    assert not torch.equal(after, before), "training did not move the model"
    assert not torch.equal(model.net[1].running_mean, torch.zeros(8)), "BatchNorm statistics did not move"
    if mode == "gossip":
        for other in COMM.allgather(after):
            torch.testing.assert_close(other, after, rtol=1e-6, atol=1e-6)
    else:
        assert_same_on_all_ranks(after, "parameters and BatchNorm statistics")


@pytest.mark.mpi(ranks=(4,), timeout=240)
@pytest.mark.parametrize("mode", sorted(MODES))
def test_a_fit_frees_the_communicators_of_its_mode_and_a_checkpoint_saves_after_it(mode: str) -> None:
    """Fits in one process (a Hydra sweep's jobs) must not each keep the mode's communicators: after the first
    fit, which builds what the process keeps (the topology), two more fits leave as many free context ids; and the
    mode's state still saves after fit (``trainer.save_checkpoint``)."""
    data = regression_data(SIZE * PER_RANK_BATCH * 6, seed=7)
    free = []
    for _ in range(3):
        fit = trainer(strategy=MPIADStrategy(sync=MODES[mode](), ranks_per_node=2), max_epochs=1)
        fit.fit(TwoGroups(), loader(data, PER_RANK_BATCH))
        free.append(free_context_ids())
    assert free[1] == free[0] and free[2] == free[0], f"free context ids after each fit: {free}"
    path = f"{shared_tmpdir()}/after-fit.ckpt"
    fit.save_checkpoint(path)
    assert torch.load(path, weights_only=False)["mpistrategy"]["sync"]["name"] == mode


@pytest.mark.mpi(ranks=(2, 4), timeout=240)
def test_a_fit_refused_after_the_mode_is_set_up_frees_its_communicators() -> None:
    """A sweep point every rank refuses once the sync mode holds its communicators (here the warm-up's
    compression, given a density that differs by rank) must free them: three refused fits leave as many free
    context ids as one."""
    data = regression_data(SIZE * PER_RANK_BATCH * 2, seed=7)
    free = []
    for _ in range(3):
        strategy = MPIADStrategy(
            sync=LocalSGD(period=3, warmup_steps=3), aggregator=TopK(density=0.1 * (RANK + 1)), ranks_per_node=2
        )
        with pytest.raises(ValueError, match="different options"):
            trainer(strategy=strategy, max_epochs=1).fit(TwoGroups(), loader(data, PER_RANK_BATCH))
        free.append(free_context_ids())
    assert free[1] == free[0] and free[2] == free[0], f"free context ids after each refused fit: {free}"
