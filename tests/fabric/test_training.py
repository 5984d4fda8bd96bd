"""Fabric with mpi_ad: N ranks with per-rank batch b train exactly like one process with batch N*b (float64), with
and without ``no_backward_sync`` accumulation; two models in one backward pass; a sync mode (local SGD); BatchNorm
statistics after synchronised steps; sparse embeddings refused at setup."""

from __future__ import annotations

import gc
import os
import signal

import pytest
import torch
from torch import nn

from mpistrategy.comm.topology import topology
from mpistrategy.strategy import MPIADFabricStrategy, fabric_release
from mpistrategy.strategy.failures import StopRequested
from mpistrategy.sync import LocalSGD, SyncConfigurationError
from tests.fabric.helpers import (
    COMM,
    OPTIMIZERS,
    RANK,
    SIZE,
    CountingMean,
    StridedNet,
    flat_parameters,
    launched,
    mlp,
    rank_batches,
    reference_training,
    regression_data,
)
from tests.mpi_resources import free_context_ids

PER_RANK = 4
STEPS = 3
TOLERANCE = dict(rtol=1e-10, atol=1e-10)


def _release_dropped_now() -> None:
    """Free at once what the Fabric objects dropped so far held (collective)."""
    gc.collect()
    fabric_release.release_dropped(topology().control)


def _same_on_every_rank(tensor: torch.Tensor) -> None:
    for other in COMM.allgather(tensor):
        assert torch.equal(other, tensor), "the ranks' parameters differ"


@pytest.mark.mpi(ranks=(2, 3), timeout=90)
@pytest.mark.parametrize("accumulate", [1, 3])
@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_matches_single_process_whole_batch(optimizer: str, accumulate: int) -> None:
    data = regression_data(SIZE * PER_RANK * accumulate * STEPS)
    counting = CountingMean()
    fabric = launched(MPIADFabricStrategy(aggregator=counting))
    net = mlp(seed=1)
    model, opt = fabric.setup(net, OPTIMIZERS[optimizer](net.parameters()))
    assert fabric.world_size == SIZE
    for index, (x, y) in enumerate(rank_batches(fabric, data, PER_RANK)):
        last_micro_batch = (index + 1) % accumulate == 0
        with fabric.no_backward_sync(model, enabled=not last_micro_batch):
            fabric.backward(nn.functional.mse_loss(model(x), y) / accumulate)
        if last_micro_batch:
            opt.step()
            opt.zero_grad()
    # one combination per bucket and optimizer step: the micro-batches inside no_backward_sync did not communicate
    assert counting.combined == STEPS * counting.buckets

    reference = mlp(seed=1)
    ref_opt = OPTIMIZERS[optimizer](reference.parameters())
    reference_training(reference, data, SIZE * PER_RANK, STEPS, ref_opt, accumulate=accumulate)
    got, want = flat_parameters(model), flat_parameters(reference)
    assert not torch.equal(want, flat_parameters(mlp(seed=1))), "the reference did not train"
    torch.testing.assert_close(got, want, **TOLERANCE)
    torch.testing.assert_close(opt.state_dict()["state"], ref_opt.state_dict()["state"], **TOLERANCE)
    _same_on_every_rank(got)


@pytest.mark.mpi(ranks=(2, 3), timeout=60)
def test_parameters_with_strides_take_rank_zeros_values_and_train_like_one_process() -> None:
    """A ``channels_last`` convolution and a transposed weight, each rank from its own seed: rank 0's values after
    setup, then AdamW equal to one process on the whole batch; the parameters keep their strides."""
    data = regression_data(SIZE * PER_RANK * STEPS)
    fabric = launched()
    net = StridedNet(seed=20 + RANK)
    model, opt = fabric.setup(net, OPTIMIZERS["adamw"](net.parameters()))
    for x, y in rank_batches(fabric, data, PER_RANK):
        fabric.backward(nn.functional.mse_loss(model(x), y))
        opt.step()
        opt.zero_grad()
    reference = StridedNet(seed=20)
    ref_opt = OPTIMIZERS["adamw"](reference.parameters())
    reference_training(reference, data, SIZE * PER_RANK, STEPS, ref_opt)
    assert net.strided() and reference.strided()
    torch.testing.assert_close(flat_parameters(model), flat_parameters(reference), **TOLERANCE)
    _same_on_every_rank(flat_parameters(model))


@pytest.mark.mpi(ranks=(2, 3), timeout=60)
def test_setup_broadcasts_rank_zero_parameters_and_buffers() -> None:
    fabric = launched()
    model = mlp(seed=10 + RANK, batchnorm=True)
    with torch.no_grad():
        model[1].running_mean.fill_(float(RANK + 1))
    rank_zero = COMM.bcast({k: v.clone() for k, v in model.state_dict().items()}, root=0)
    model = fabric.setup(model)
    for name, value in model.state_dict().items():
        assert torch.equal(value, rank_zero[name]), name


@pytest.mark.mpi(ranks=(2, 3), timeout=60)
def test_a_model_that_differs_on_one_rank_raises_on_every_rank() -> None:
    fabric = launched()
    with pytest.raises(ValueError, match=rf"rank {SIZE - 1} has '0.weight' of shape \[9, 6\] \(float64\) where rank 0"):
        fabric.setup(mlp(hidden=9 if RANK == SIZE - 1 else 8))
    COMM.Barrier()  # every rank raised: none is left in a collective


class Generator(nn.Module):
    """A generator whose extra head is used only on rank 0 (a parameter some ranks leave unused)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.body = nn.Linear(4, 6).double()
        self.head = nn.Linear(6, 6).double()

    def forward(self, z: torch.Tensor, rank: int) -> torch.Tensor:
        out = torch.tanh(self.body(z))
        return self.head(out) if rank == 0 else out


def _critic() -> nn.Module:
    torch.manual_seed(4)
    return nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 1)).double()


def _losses(generator: nn.Module, critic: nn.Module, z: torch.Tensor, rank: int) -> torch.Tensor:
    return critic(generator(z, rank)).pow(2).mean()


@pytest.mark.mpi(ranks=(2, 3), timeout=60)
@pytest.mark.parametrize("named", [None, "generator", "critic"])
def test_two_models_in_one_backward_match_single_process(named: str | None) -> None:
    """Two models set up separately (one with ``setup``, one with ``setup_module`` then ``setup_optimizers``), one
    backward pass through both, a parameter used on rank 0 only: each model's gradients are the average over the
    ranks (zero from the ranks that did not use it), on its own channels; also when ``fabric.backward`` names one
    of the models (as under DDP, the other model's gradients are averaged too)."""
    fabric = launched()
    generator, critic = Generator(), _critic()
    g_opt = torch.optim.SGD(generator.parameters(), lr=0.1, momentum=0.9)
    c_opt = torch.optim.AdamW(critic.parameters(), lr=0.05)
    generator, g_opt = fabric.setup(generator, g_opt)
    critic = fabric.setup_module(critic)  # the other way: the model first, then its optimizer
    c_opt = fabric.setup_optimizers(c_opt)
    assert len(fabric.strategy.engines) == 2
    inputs = torch.randn(STEPS, SIZE, 5, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    for step in range(STEPS):
        model = {"generator": generator, "critic": critic}.get(named or "")
        fabric.backward(_losses(generator, critic, inputs[step, RANK], RANK), model=model)
        g_opt.step()
        c_opt.step()
        g_opt.zero_grad()
        c_opt.zero_grad()

    ref_generator, ref_critic = Generator(), _critic()
    ref_g = torch.optim.SGD(ref_generator.parameters(), lr=0.1, momentum=0.9)
    ref_c = torch.optim.AdamW(ref_critic.parameters(), lr=0.05)
    for step in range(STEPS):
        sum(_losses(ref_generator, ref_critic, inputs[step, r], r) for r in range(SIZE)).div(SIZE).backward()
        for optimizer in (ref_g, ref_c):
            optimizer.step()
            optimizer.zero_grad()
    for trained, reference in ((generator, ref_generator), (critic, ref_critic)):
        torch.testing.assert_close(flat_parameters(trained), flat_parameters(reference), **TOLERANCE)
    # the second model's own channels go with the strategy's teardown: set up and torn down again, the same count
    fabric.strategy.teardown()
    _release_dropped_now()  # what earlier tests' Fabric objects held, which the first setup below would free
    free = free_context_ids()
    again = launched()
    for model in (Generator(), _critic()):
        again.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert len(again.strategy.engines) == 2
    refused = nn.Embedding(4, 2, sparse=True)  # a third model, refused on every rank, keeps no channel
    before_refusal = free_context_ids()
    with pytest.raises(ValueError, match="would get sparse"):
        again.setup(refused, torch.optim.SGD(refused.parameters(), lr=0.1))
    assert free_context_ids() == before_refusal
    again.strategy.teardown()
    assert free_context_ids() == free


@pytest.mark.mpi(ranks=(2, 3), timeout=60)
def test_local_sgd_by_name_averages_models_every_period() -> None:
    """``Fabric(strategy="mpi_local_sgd")``: local steps, then the models averaged every ``period`` steps, exactly as
    N replicas trained one by one and averaged in one process."""
    fabric = launched(MPIADFabricStrategy(sync=LocalSGD(period=2)))
    assert type(launched("mpi_local_sgd").strategy.sync) is LocalSGD
    data = regression_data(SIZE * PER_RANK * 4)
    model = mlp(seed=5)
    model, opt = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.2))
    after_step = []
    for x, y in rank_batches(fabric, data, PER_RANK):
        fabric.backward(nn.functional.mse_loss(model(x), y))
        opt.step()
        opt.zero_grad()
        after_step.append(flat_parameters(model))

    replicas = [mlp(seed=5) for _ in range(SIZE)]
    optimizers = [torch.optim.SGD(r.parameters(), lr=0.2) for r in replicas]
    x, y = data.tensors
    for step in range(4):
        for r, (replica, optimizer) in enumerate(zip(replicas, optimizers, strict=True)):
            rows = [SIZE * (step * PER_RANK + k) + r for k in range(PER_RANK)]
            nn.functional.mse_loss(replica(x[rows]), y[rows]).backward()
            optimizer.step()
            optimizer.zero_grad()
        if step % 2 == 1:
            mean = torch.stack([flat_parameters(r) for r in replicas]).mean(0)
            for replica in replicas:
                torch.nn.utils.vector_to_parameters(mean.clone(), replica.parameters())
        torch.testing.assert_close(after_step[step], flat_parameters(replicas[RANK]), **TOLERANCE)
    assert not torch.equal(COMM.allgather(after_step[0])[0], COMM.allgather(after_step[0])[1])  # a local step
    _same_on_every_rank(after_step[-1])


@pytest.mark.mpi(ranks=(2, 3), timeout=90)
@pytest.mark.parametrize("added", ["in setup", "after setup"])
def test_local_sgd_refuses_a_second_optimizer_however_it_is_added(added: str) -> None:
    """A mode that averages the model after each optimizer step refuses a second optimizer of the model on every
    rank, also one added by ``fabric.setup_optimizers`` after the model was set up; the model trains on with the
    first optimizer alone, averaged every ``period`` of its steps."""
    fabric = launched(MPIADFabricStrategy(sync=LocalSGD(period=2)))
    model = mlp(seed=5)
    first = torch.optim.SGD(model[0].parameters(), lr=0.2)
    second = torch.optim.SGD(model[2].parameters(), lr=0.2)
    refused = "local_sgd: averages the model after each optimizer step, which is ambiguous with 2 optimizers"
    if added == "in setup":
        with pytest.raises(SyncConfigurationError, match=refused):
            fabric.setup(model, first, second)
        model, first = fabric.setup(model, first)
    else:
        model, first = fabric.setup(model, first)
        with pytest.raises(SyncConfigurationError, match=refused):
            fabric.setup_optimizers(second)
    assert fabric.strategy.engines[-1].optimizers == [first.optimizer]
    x = torch.full((2, 6), float(RANK), dtype=torch.float64)
    for _ in range(2):
        fabric.backward(model(x).pow(2).mean())
        first.step()
        first.zero_grad()
    _same_on_every_rank(flat_parameters(model))


@pytest.mark.mpi(ranks=(2, 3), timeout=90)
@pytest.mark.parametrize("mode", ["flat", "local_sgd"])
def test_batchnorm_statistics_follow_rank_zero_after_each_synchronised_step(mode: str) -> None:
    # under flat every rank then holds rank 0's running statistics (as DDP's buffer broadcast): a BatchNorm fed only
    # rank 0's batches is the reference; local SGD (no averaging within these steps) keeps each rank's own replica,
    # buffers included
    strategy = MPIADFabricStrategy(sync=LocalSGD(period=100)) if mode == "local_sgd" else MPIADFabricStrategy()
    fabric = launched(strategy)
    torch.manual_seed(0)
    net = nn.Sequential(nn.BatchNorm1d(3, momentum=0.3), nn.Linear(3, 1)).double()
    model, opt = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9))
    own = nn.BatchNorm1d(3, momentum=0.3).double()  # this rank's batches only
    from_rank_zero = nn.BatchNorm1d(3, momentum=0.3).double()
    for step in range(4):
        batches = [
            torch.randn(5, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(10 * step + r)) * (r + 1)
            for r in range(SIZE)
        ]
        accumulating = step % 2 == 0
        with fabric.no_backward_sync(model, enabled=accumulating):
            fabric.backward(model(batches[RANK]).pow(2).mean())
        own(batches[RANK])
        from_rank_zero(batches[0])
        if not accumulating:
            opt.step()
            opt.zero_grad()
            if mode == "flat":
                own.load_state_dict(from_rank_zero.state_dict())
            else:
                from_rank_zero.load_state_dict(own.state_dict())
    bn = model.module[0] if hasattr(model, "module") else model[0]
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        torch.testing.assert_close(getattr(bn, name), getattr(own, name), rtol=1e-12, atol=1e-12)
    if mode == "flat":
        _same_on_every_rank(bn.running_mean)
    else:
        assert not torch.equal(COMM.allgather(bn.running_mean)[0], COMM.allgather(bn.running_mean)[1])


@pytest.mark.mpi(ranks=(2, 3), timeout=90)
@pytest.mark.parametrize("sparse_on", ["every rank", "rank 1"])
def test_sparse_embedding_refused_at_setup_and_not_kept(sparse_on: str) -> None:
    fabric = launched()
    sparse = sparse_on == "every rank" or RANK == 1
    embedding = nn.Sequential(nn.Embedding(10, 3, sparse=sparse))
    expected = ValueError if sparse else SyncConfigurationError
    with pytest.raises(
        expected,
        match="'0.weight' would get sparse ones; build the embedding with sparse=False" if sparse else "rank 1",
    ):
        fabric.setup(embedding, torch.optim.SGD(embedding.parameters(), lr=0.1))
    # the refused model has no engine: a backward through another model (Fabric names none) averages that one
    net = nn.Linear(3, 1).double()
    model, _ = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    fabric.backward(model(torch.full((1, 3), float(RANK), dtype=torch.float64)).sum())
    torch.testing.assert_close(net.weight.grad, torch.full((1, 3), (SIZE - 1) / 2, dtype=torch.float64))


TRIALS = 30


def _trial(seed: int) -> tuple[torch.optim.Optimizer, int]:
    """One trial with a Fabric object of its own and two models, dropped at the end as a program dropping a trial
    does; checks that its gradients are the average over the ranks. Returns one of its raw optimizers and the free
    context ids while the trial holds its models."""
    fabric = launched()
    nets = [mlp(seed=seed), mlp(seed=seed + 1)]
    references = [mlp(seed=seed), mlp(seed=seed + 1)]
    raw = [torch.optim.SGD(net.parameters(), lr=0.1) for net in nets]
    models = [fabric.setup(net, optimizer)[0] for net, optimizer in zip(nets, raw, strict=True)]
    x = torch.randn(3, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(seed * SIZE + RANK))
    fabric.backward(sum(model(x).pow(2).mean() for model in models))
    sum(reference(x).pow(2).mean() for reference in references).backward()
    for model, reference in zip(models, references, strict=True):
        local = torch.cat([p.grad.flatten() for p in reference.parameters()])
        average = torch.stack(COMM.allgather(local)).mean(0)
        torch.testing.assert_close(torch.cat([p.grad.flatten() for p in model.parameters()]), average, **TOLERANCE)
    return raw[0], free_context_ids()


@pytest.mark.mpi(ranks=(2, 3), timeout=180)
def test_fabric_objects_the_program_drops_free_what_they_held() -> None:
    """Fabric never tears its strategy down. A program that makes a Fabric object per trial and drops it (Optuna, a
    sweep in one process) gets back what the dropped ones held at a later model setup: over 30 trials of two models
    each, the communicator context ids in use stay below those of a few trials (kept, they would grow by a trial's
    count per trial and run out after a few hundred trials), and once every trial is collected all are free again.
    A released trial's optimizer has its own class back."""
    _trial(1000)  # what the first Fabric object of a process makes once, and keeps
    _release_dropped_now()
    free = free_context_ids()
    first_optimizer, during_first = _trial(0)
    per_trial = free - during_first
    assert per_trial > 0
    lowest = during_first
    for trial in range(1, TRIALS):
        lowest = min(lowest, _trial(10 * trial)[1])
    assert free - lowest <= (fabric_release.FULL_COLLECTION_FROM + 2) * per_trial, (free, lowest, per_trial)
    assert type(first_optimizer) is torch.optim.SGD
    _release_dropped_now()
    assert free_context_ids() == free


@pytest.mark.mpi(ranks=(2, 3), timeout=60)
def test_a_torn_down_strategy_leaves_a_later_strategys_stop_signals_in_place() -> None:
    """Two Fabric objects train in turn; the first is torn down while the second trains: SIGUSR1 on rank 0 then
    still stops every rank together at the second's next optimizer steps (it is not handed back to the handler
    from before the first, which would end the process)."""
    first, second = launched(), launched()
    steppers = []
    for fabric in (first, second):
        net = mlp(seed=7)
        model, optimizer = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
        steppers.append((fabric, model, optimizer))
    x = torch.randn(2, 6, dtype=torch.float64)
    for fabric, model, optimizer in steppers:
        fabric.backward(model(x).sum())
        optimizer.step()
    first.strategy.teardown()
    fabric, model, optimizer = steppers[1]
    if RANK == 0:
        os.kill(os.getpid(), signal.SIGUSR1)
    steps = 0
    with pytest.raises(StopRequested) as stopped:
        while steps < 3:
            fabric.backward(model(x).sum())
            steps += 1
            optimizer.step()
    assert stopped.value.signal_name == "SIGUSR1" and steps == 2  # one step after the signal, as always
    second.strategy.teardown()
