"""Fabric with ``MPIADFabricStrategy(shard=...)`` (ZeRO stages 1 and 2): training equals one process with the whole
batch (AdamW and momentum, norm clipping, ``no_backward_sync`` accumulation); ``fabric.save`` writes one shard file
per rank and a manifest, ``fabric.load`` restores the state exactly (training then continues bit for bit), also into
an unsharded run and through ``fabric.load_raw``; ``consolidate`` and ``mpistrategy-consolidate`` give the whole
optimizer state from a checkpoint, ``strategy.consolidated_optimizer_state`` from the running ranks."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from torch import nn

from mpistrategy.strategy import MPIADFabricStrategy
from mpistrategy.strategy.sharding.checkpoint import KEY, consolidate
from tests.fabric.helpers import (
    COMM,
    OPTIMIZERS,
    RANK,
    SIZE,
    flat_parameters,
    launched,
    mlp,
    rank_batches,
    reference_training,
    regression_data,
    shared_tmpdir,
)
from tests.mpi_harness import clean_environ

PER_RANK = 4
STEPS = 3
CLIP = 0.05
MODES = ("optimizer", "gradients")


def _set_up(fabric, seed: int, optimizer: str = "adamw"):
    net = mlp(seed=seed)
    return fabric.setup(net, OPTIMIZERS[optimizer](net.parameters()))


def _train(fabric, model, optimizer, data, accumulate: int = 1) -> None:
    """Steps over ``data`` with norm clipping; ``accumulate`` micro-batches per step inside ``no_backward_sync``."""
    for index, (x, y) in enumerate(rank_batches(fabric, data, PER_RANK)):
        last_micro_batch = (index + 1) % accumulate == 0
        with fabric.no_backward_sync(model, enabled=not last_micro_batch):
            fabric.backward(nn.functional.mse_loss(model(x), y) / accumulate)
        if last_micro_batch:
            fabric.clip_gradients(model, optimizer, max_norm=CLIP)
            optimizer.step()
            optimizer.zero_grad()


def _consolidate_command(path: str, out: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "mpistrategy.strategy.sharding.cli", path, out]
    return subprocess.run(command, env=clean_environ(), capture_output=True, text=True, timeout=120, check=False)


def _state_on_rank_zero(path: str) -> dict:
    """The checkpoint's optimizer state, consolidated (rank 0 reads it; every rank gets it)."""
    return COMM.bcast(consolidate(path)["optimizer"] if RANK == 0 else None, root=0)


@pytest.mark.mpi(ranks=(2, 3), timeout=120)
@pytest.mark.parametrize("shard", MODES)
def test_steps_of_the_optimizer_given_to_setup_reach_every_rank(shard: str) -> None:
    """The loop steps the torch optimizer it gave ``fabric.setup``, not the wrapper it got back: every rank's
    updated shard still reaches the others, and training equals one process with the whole batch."""
    data = regression_data(SIZE * PER_RANK * STEPS)
    fabric = launched(MPIADFabricStrategy(shard=shard))
    net = mlp(seed=1)
    optimizer = OPTIMIZERS["adamw"](net.parameters())
    model, _ = fabric.setup(net, optimizer)
    for x, y in rank_batches(fabric, data, PER_RANK):
        fabric.backward(nn.functional.mse_loss(model(x), y))
        optimizer.step()
        optimizer.zero_grad()

    reference = mlp(seed=1)
    reference_training(reference, data, SIZE * PER_RANK, STEPS, OPTIMIZERS["adamw"](reference.parameters()))
    torch.testing.assert_close(flat_parameters(model), flat_parameters(reference), rtol=0, atol=1e-10)


@pytest.mark.mpi(ranks=(2, 3), timeout=120)
@pytest.mark.parametrize("accumulate", [1, 2])
@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
@pytest.mark.parametrize("shard", MODES)
def test_sharded_training_matches_single_process_whole_batch(shard: str, optimizer: str, accumulate: int) -> None:
    data = regression_data(SIZE * PER_RANK * accumulate * STEPS)
    fabric = launched(MPIADFabricStrategy(shard=shard))
    model, opt = _set_up(fabric, seed=1, optimizer=optimizer)
    _train(fabric, model, opt, data, accumulate)

    reference = mlp(seed=1)
    ref_opt = OPTIMIZERS[optimizer](reference.parameters())
    reference_training(reference, data, SIZE * PER_RANK, STEPS, ref_opt, accumulate=accumulate, clip=CLIP)
    want = flat_parameters(reference)
    assert not torch.equal(want, flat_parameters(mlp(seed=1))), "the reference did not train"
    torch.testing.assert_close(flat_parameters(model), want, rtol=1e-10, atol=1e-10)
    # each rank holds the optimizer state of its shard only: together the ranks hold every element once
    held = sum(t.numel() for state in opt.state.values() for t in state.values() if torch.is_tensor(t) and t.ndim)
    assert sum(COMM.allgather(held)) == (2 if optimizer == "adamw" else 1) * want.numel()
    # gathered on the last rank: the single process's whole state, numbered as its state_dict() numbers it
    whole = fabric.strategy.consolidated_optimizer_state(opt, to=SIZE - 1)
    if RANK == SIZE - 1:
        expected = ref_opt.state_dict()
        torch.testing.assert_close(whole["state"], expected["state"], rtol=1e-10, atol=1e-10)
        assert whole["param_groups"] == expected["param_groups"]
    else:
        assert whole is None
    fabric.strategy.teardown()  # the optimizer keeps its pieces: gathered after teardown, the same state
    again = fabric.strategy.consolidated_optimizer_state(opt, to=SIZE - 1)
    if RANK == SIZE - 1:
        torch.testing.assert_close(again, whole, rtol=0, atol=0)


@pytest.mark.mpi(ranks=(2, 3), timeout=120)
@pytest.mark.parametrize("shard", MODES)
def test_save_and_load_restore_the_sharded_state_exactly(shard: str) -> None:
    fabric = launched(MPIADFabricStrategy(shard=shard))
    path = os.path.join(shared_tmpdir(), "state.ckpt")
    model, optimizer = _set_up(fabric, seed=1)
    _train(fabric, model, optimizer, regression_data(SIZE * PER_RANK * STEPS, seed=1))
    fabric.save(path, {"model": model, "optimizer": optimizer, "step": STEPS})

    shards = sorted(os.listdir(path + ".shards"))
    assert len(shards) == SIZE and all(name.endswith(f"-of{SIZE:05d}.pt") for name in shards)
    whole = _state_on_rank_zero(path)
    assert len(whole["state"]) == len(list(model.parameters()))
    for index, parameter in enumerate(model.parameters()):
        assert whole["state"][index]["exp_avg"].shape == parameter.shape
    if RANK == 0:
        assert isinstance(torch.load(path, weights_only=False)["optimizer"][KEY], dict)  # a manifest, not the state

    restored_model, restored_optimizer = _set_up(fabric, seed=2)  # other weights, no optimizer state
    state = {"model": restored_model, "optimizer": restored_optimizer, "step": 0}
    assert fabric.load(path, state) == {}
    assert state["step"] == STEPS
    assert torch.equal(flat_parameters(restored_model), flat_parameters(model))
    # ``state_dict()`` of a sharded optimizer: the state of this rank's pieces
    torch.testing.assert_close(restored_optimizer.state_dict(), optimizer.state_dict(), rtol=0, atol=0)
    assert len(optimizer.state_dict()["state"]) > 0

    more = regression_data(SIZE * PER_RANK * STEPS, seed=2)
    _train(fabric, model, optimizer, more)
    _train(fabric, restored_model, restored_optimizer, more)
    assert torch.equal(flat_parameters(restored_model), flat_parameters(model))

    fabric.save(path, {"model": model, "optimizer": optimizer})  # the same name again: the older shards go
    assert len(os.listdir(path + ".shards")) == SIZE
    saved = _state_on_rank_zero(path)
    fabric.strategy.teardown()  # saved after teardown: the same whole state, still in shard files
    fabric.save(path, {"model": model, "optimizer": optimizer})
    assert len(os.listdir(path + ".shards")) == SIZE
    torch.testing.assert_close(_state_on_rank_zero(path), saved, rtol=0, atol=0)


@pytest.mark.mpi(ranks=(2, 3), timeout=120)
def test_a_sharded_checkpoint_loads_into_an_unsharded_run_and_raw() -> None:
    path = os.path.join(shared_tmpdir(), "state.ckpt")
    fabric = launched(MPIADFabricStrategy(shard="gradients"))
    model, optimizer = _set_up(fabric, seed=1)
    _train(fabric, model, optimizer, regression_data(SIZE * PER_RANK * STEPS, seed=1))
    fabric.save(path, {"model": model, "optimizer": optimizer})
    whole = _state_on_rank_zero(path)

    plain = launched(MPIADFabricStrategy())
    returned = plain.load(path)  # Fabric's pattern: the checkpoint itself back, its optimizer state consolidated
    torch.testing.assert_close(returned["optimizer"]["state"], whole["state"], rtol=0, atol=0)
    assert [g["params"] for g in returned["optimizer"]["param_groups"]] == [g["params"] for g in whole["param_groups"]]
    plain_model, plain_optimizer = _set_up(plain, seed=2)
    remainder = plain.load(path, {"model": plain_model}, strict=False)  # what is not restored comes back whole
    plain_optimizer.load_state_dict(remainder["optimizer"])
    torch.testing.assert_close(plain_optimizer.state_dict()["state"], whole["state"], rtol=0, atol=0)
    plain.load(path, {"model": plain_model, "optimizer": plain_optimizer})
    assert torch.equal(flat_parameters(plain_model), flat_parameters(model))
    torch.testing.assert_close(plain_optimizer.state_dict()["state"], whole["state"], rtol=0, atol=0)

    directory = shared_tmpdir()  # collective
    raw, consolidated = os.path.join(directory, "optimizer.pt"), os.path.join(directory, "plain.ckpt")
    if RANK == 0:
        done = _consolidate_command(path, consolidated)
        assert done.returncode == 0 and "wrote" in done.stdout, done.stderr
        plain_file = torch.load(consolidated, weights_only=False)
        torch.testing.assert_close(plain_file["optimizer"]["state"], whole["state"], rtol=0, atol=0)
        torch.save(plain_file["optimizer"], raw)
        with open(path, "r+b") as handle:  # damaged: the command names the problem and fails
            handle.seek(200)
            handle.write(b"\0\1\2\3")
        done = _consolidate_command(path, consolidated)
        assert done.returncode == 1 and "corrupt" in done.stderr.lower() and "Traceback" not in done.stderr
    COMM.Barrier()
    _, sharded_optimizer = _set_up(fabric, seed=3)
    fabric.load_raw(raw, sharded_optimizer)  # a plain state dict into a sharded optimizer: each rank its pieces
    torch.testing.assert_close(sharded_optimizer.state_dict(), optimizer.state_dict(), rtol=0, atol=0)


@pytest.mark.mpi(ranks=(2, 3), timeout=120)
@pytest.mark.parametrize("wrong", ["out of range", "another rank", "not an optimizer"])
def test_consolidation_with_a_wrong_argument_on_one_rank_raises_on_every_rank(wrong: str) -> None:
    fabric = launched(MPIADFabricStrategy(shard="optimizer"))
    _, optimizer = _set_up(fabric, seed=1)
    given, to = optimizer, 0
    if RANK == SIZE - 1:
        given, to = {"out of range": (optimizer, SIZE), "another rank": (optimizer, 1), "not an optimizer": ({}, 0)}[
            wrong
        ]
    with pytest.raises(Exception) as raised:
        fabric.strategy.consolidated_optimizer_state(given, to=to)
    message = str(raised.value)
    assert "consolidated_optimizer_state" in message, message
    if RANK == SIZE - 1 and wrong != "another rank":
        assert (f"to={SIZE}" if wrong == "out of range" else "expected a torch optimizer") in message, message
    whole = fabric.strategy.consolidated_optimizer_state(optimizer, to=0)  # the ranks go on together
    assert (whole is not None) == (RANK == 0)


@pytest.mark.mpi(ranks=(2, 3), timeout=120)
def test_a_large_bucket_inside_one_shard_is_reduce_scattered() -> None:
    """Stage 2 with 1 MB buckets: the 4.2 MB bucket of the second layer lies inside the last shard(s), so some ranks
    have no block of it (a reduce-scatter with zero counts, which MPICH's in-place variant cannot do)."""

    def wide() -> nn.Module:
        torch.manual_seed(7)
        layers = [nn.Linear(6, 512), nn.Tanh(), nn.Linear(512, 1024), nn.Tanh(), nn.Linear(1024, 1024), nn.Tanh()]
        return nn.Sequential(*layers, nn.Linear(1024, 2)).double()

    data = regression_data(SIZE * PER_RANK * 2)
    fabric = launched(MPIADFabricStrategy(shard="gradients", bucket_cap_mb=1.0))
    net = wide()
    model, optimizer = fabric.setup(net, torch.optim.AdamW(net.parameters(), lr=0.01))
    buckets = fabric.strategy.engines[0].sharding.gradients.buckets
    assert any(b.numel >= 262_144 and 0 in b.counts for b in buckets), [b.counts for b in buckets]
    _train(fabric, model, optimizer, data)

    reference = wide()
    reference_training(
        reference, data, SIZE * PER_RANK, 2, torch.optim.AdamW(reference.parameters(), lr=0.01), clip=CLIP
    )
    torch.testing.assert_close(flat_parameters(model), flat_parameters(reference), rtol=1e-10, atol=1e-10)


def _replace_gradients(net: nn.Module, step: int) -> None:
    """As torch code does between backward and step: the first layer skipped every other step, the last layer's
    gradient halved into a new tensor."""
    if step % 2 == 0:
        net[0].weight.grad = None
    net[-1].weight.grad = net[-1].weight.grad * 0.5


@pytest.mark.mpi(ranks=(2, 3), timeout=120)
@pytest.mark.parametrize("clip", ["norm", "value"])
def test_stage_one_steps_the_gradients_the_user_put_in_place_of_backwards(clip: str) -> None:
    """Under ``shard="optimizer"`` the pieces view the parameters' gradients: a ``.grad`` replaced after backward is
    the one clipped and stepped, as in one process. The learning-rate schedule is made after ``fabric.setup`` (it
    wraps the optimizer's ``step``, which the sharding wrapped first)."""
    data = regression_data(SIZE * PER_RANK * 4, seed=3)
    fabric = launched(MPIADFabricStrategy(shard="optimizer"))
    net = mlp(seed=2)
    raw = torch.optim.SGD(net.parameters(), lr=0.2, momentum=0.9)
    model, optimizer = fabric.setup(net, raw)
    schedule = torch.optim.lr_scheduler.StepLR(raw, step_size=1, gamma=0.5)
    for step, (x, y) in enumerate(rank_batches(fabric, data, PER_RANK)):
        fabric.backward(nn.functional.mse_loss(model(x), y))
        _replace_gradients(net, step)
        if clip == "norm":
            fabric.clip_gradients(model, optimizer, max_norm=CLIP)
        else:
            fabric.clip_gradients(model, optimizer, clip_val=CLIP)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad()

    reference = mlp(seed=2)
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.2, momentum=0.9)
    ref_schedule = torch.optim.lr_scheduler.StepLR(ref_optimizer, step_size=1, gamma=0.5)
    x, y = data.tensors
    for step in range(4):
        ref_optimizer.zero_grad()
        block = slice(step * SIZE * PER_RANK, (step + 1) * SIZE * PER_RANK)
        nn.functional.mse_loss(reference(x[block]), y[block]).backward()
        _replace_gradients(reference, step)
        if clip == "norm":
            torch.nn.utils.clip_grad_norm_(reference.parameters(), CLIP)
        else:
            torch.nn.utils.clip_grad_value_(reference.parameters(), CLIP)
        ref_optimizer.step()
        ref_schedule.step()
    assert not torch.equal(flat_parameters(reference), flat_parameters(mlp(seed=2))), "the reference did not train"
    torch.testing.assert_close(flat_parameters(model), flat_parameters(reference), rtol=0, atol=1e-12)


def _hook_gradients(net: nn.Module) -> None:
    """Hooks that edit gradients as they are accumulated (the first layer's replaced, the last's scaled in place)."""

    def replace(param: torch.Tensor) -> None:
        param.grad = param.grad * 2

    def scale(param: torch.Tensor) -> None:
        param.grad.mul_(0.5)

    net[0].weight.register_post_accumulate_grad_hook(replace)
    net[-1].weight.register_post_accumulate_grad_hook(scale)


@pytest.mark.mpi(ranks=(2, 3), timeout=120)
@pytest.mark.parametrize("shard", [None, *MODES])
def test_gradient_hooks_registered_after_setup_run_before_the_average(shard: str | None) -> None:
    """Hooks of the user's added after ``fabric.setup`` edit each gradient before its bucket (one per parameter,
    each started during backward) is averaged: training equals one process with the same hooks."""
    data = regression_data(SIZE * PER_RANK * STEPS, seed=4)
    fabric = launched(MPIADFabricStrategy(shard=shard, bucket_cap_mb=1e-4, own_bucket_mb=1e-4))
    net = mlp(seed=3)
    model, optimizer = fabric.setup(net, OPTIMIZERS["sgd-momentum"](net.parameters()))
    _hook_gradients(net)
    for x, y in rank_batches(fabric, data, PER_RANK):
        fabric.backward(nn.functional.mse_loss(model(x), y))
        optimizer.step()
        optimizer.zero_grad()

    reference = mlp(seed=3)
    _hook_gradients(reference)
    reference_training(reference, data, SIZE * PER_RANK, STEPS, OPTIMIZERS["sgd-momentum"](reference.parameters()))
    torch.testing.assert_close(flat_parameters(model), flat_parameters(reference), rtol=0, atol=1e-12)
